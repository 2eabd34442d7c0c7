import sys

from flashcheck.verify.cli import main

sys.exit(main())
