"""``python -m streamrl ...`` is the ``streamrl`` command."""

from streamrl.cli.main import main

raise SystemExit(main())
