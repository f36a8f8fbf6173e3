import sys

from healthgate.cli.main import main

sys.exit(main())
