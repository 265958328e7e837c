"""`python -m service` is `kestrel`."""

import sys

from service.cli import main

sys.exit(main())
