import sys

from mlaprefill.cli import main

sys.exit(main())
