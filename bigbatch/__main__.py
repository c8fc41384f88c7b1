"""`python -m bigbatch ...` (and `torchrun ... -m bigbatch train ...`)."""

from bigbatch.cli.main import main

raise SystemExit(main())
