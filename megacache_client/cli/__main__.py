"""`python -m megacache_client.cli`: the `megacache` command without its script."""

import sys

from megacache_client.cli import main

sys.exit(main())
