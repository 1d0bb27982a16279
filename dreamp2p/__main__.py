"""`python -m dreamp2p`: the same command line as the `dreamp2p` console script."""

from dreamp2p.cli import main

raise SystemExit(main())
