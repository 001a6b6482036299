import sys

from rlhf_async.cli.main import main

sys.exit(main())
