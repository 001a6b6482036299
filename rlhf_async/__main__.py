from rlhf_async.cli.main import entry

entry()
