"""The node programs: what runs inside each process of a Separation job, one package per
program (`generator/`, `scorer/`, `trainer/`, with `common/` shared by the three) and the
transport demo's (`demo_pipeline.py`). Each package's `main` is the program's entry
(`"nodes.trainer.main:main"`); the library names them only as such strings
(`strategies/separation/runner.py`) and never imports this package."""
