import sys

from engine.entrypoints.cli import main

sys.exit(main())
