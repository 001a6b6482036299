from rlhf_async.runtime.process import leave, main

leave(main())
