"""`python -m kestrel` is the `kestrel` command."""

import sys

from kestrel.service.cli import main

sys.exit(main())
