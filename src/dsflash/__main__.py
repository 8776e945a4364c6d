import sys

from dsflash.cli.main import main

sys.exit(main())
