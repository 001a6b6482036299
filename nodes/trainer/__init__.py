"""The trainer node: the loop (`main`), a step's batch from its chunks (`assembler`) and the
trainer's ranks as one group (`group`)."""
