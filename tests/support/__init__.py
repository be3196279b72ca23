"""ddp_sigterm's test support, ``ddp_sigterm_tests``: what the tests, the tools, the benchmarks and the demo share.

One importable package, installed (editable) in every environment that runs a job of the suite (``make`` does it:
``pip install -e tests/support``), so that the tests, a rank started by torchrun, srun or Lightning's launcher, and a
benchmark all import it the same way, with no ``sys.path`` edit:

* :mod:`.scenario` and :mod:`.injection`: the description of a job, which its processes read, and the faults it
  injects into itself;
* :mod:`.harness`: starting a job's processes, each in its own process group with a hard timeout, sending outside
  signals, reading what each rank reported; :mod:`.helpers`: the assertions the tests share;
* the jobs themselves, run as scripts on every rank: :mod:`.scenario_train` (a Trainer), :mod:`.uneven_loop` (the
  schedule's re-sync);
* :mod:`.nodes` (network-namespace nodes, root) and :mod:`.slurm_cluster` (a private SLURM cluster:
  ``python -m ddp_sigterm_tests.slurm_cluster up build/slurm``).

Standard library only but for the jobs and :mod:`.helpers`, which need torch.
"""
