import sys

from megacache_server.cli import main

sys.exit(main())
