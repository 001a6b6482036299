import sys

from rlhf_async.cli import main

sys.exit(main())
