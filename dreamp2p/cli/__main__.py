"""`python -m dreamp2p.cli`: the console script's command line (what the daemon launchers and tests run)."""

from dreamp2p.cli import main

raise SystemExit(main())
