"""What a running engine needs to explain itself, read from the driver's side without the workers' help: every
rank's state, history, ledger, stacks and logs (workers.py, stacks.py), who waits for whom and the hang detector
(hang.py), bundles (bundle.py) with the ledgers in PyTorch Flight Recorder's format (torch_fr.py). The engine and
the executors import it; the tools that drive an engine from outside are in devharness/monitor/."""
