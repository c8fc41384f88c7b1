"""`python -m bigbatch ...` (and `torchrun ... -m bigbatch train ...`)."""

from bigbatch.cli import main

raise SystemExit(main())
