import sys

from hostsync.cli import main

sys.exit(main())
