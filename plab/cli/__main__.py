import sys

from plab.cli import main

sys.exit(main())
