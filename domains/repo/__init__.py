"""Repository tasks (SWE style): a small repository, a problem statement, and hidden tests
that decide (``FAIL_TO_PASS`` and ``PASS_TO_PASS``). The ``repo_tests`` verifier kind
(:mod:`streamrl.domains.kinds.repo_tests`) judges them; :mod:`.files` reads a repository
(inline, a local directory, a git checkout at a commit) and applies diffs to it;
:mod:`.generate` writes a generated set of small Python repositories with seeded bugs;
:mod:`.swebench` reads SWE-bench-style instances whose snapshots are local."""
