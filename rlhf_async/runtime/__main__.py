import sys

from rlhf_async.runtime.process import main

sys.exit(main())
