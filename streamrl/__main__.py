"""``python -m streamrl ...`` is the ``streamrl`` command."""

from streamrl.actors.cli import main

raise SystemExit(main())
