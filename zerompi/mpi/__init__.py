"""The MPI layer: the only place in zerompi that imports :mod:`mpi4py`.

One module per concern:

* :mod:`.collectives`: :class:`zerompi.mpi.collectives.Comm`, the exact-count data
  path (``Reduce_scatter``, ``Allgatherv``, their nonblocking and prepared forms)
  and the small collectives around it;
* :mod:`.requests`: started collectives (``Pending``) and prepared ones (``Planned``);
* :mod:`.agreement`: :class:`zerompi.mpi.agreement.CollectiveError`, collective
  validation, the running fingerprint of the collectives a rank makes;
* :mod:`.shm`: node-local shared memory (file-backed, unlinked once mapped) and fences;
* :mod:`.io`: MPI-IO for checkpoints;
* :mod:`.watchdog`: deadlines on every wait, with a diagnosis before the abort;
* :mod:`.bare`: the benchmark's unwrapped collectives (its bare-MPI baseline);
* :mod:`.launch`: the abort hook and the launcher checks. It never imports
  ``mpi4py.MPI`` itself (importing it initialises MPI), so ``import zerompi`` can
  install the hook on a machine, or in a process, without MPI.

Nothing is imported here, for the same reason: ``zerompi.mpi.launch`` must stay
importable without initialising MPI.
"""

import os as _os

# Launched with `mpiexec --with-ft ulfm` (zerompi.elastic), two Open MPI settings, made
# here, on `import zerompi`, before mpi4py initialises MPI (a value the user set wins):
# * coll/han off: over two (SLURM) nodes, Open MPI 5.0.11's hierarchical collectives
#   returned from an Allgather whose peer had been SIGKILLed with success and garbage
#   in the receive buffer, instead of MPI_ERR_PROC_FAILED (the step's agreement caught
#   it: "the step count differs between ranks"); without han the failure is reported;
# * no closing PMIx fence in MPI_Finalize: after a lost rank it now and then never
#   completed (3 hangs in 88 runs here; none in 120 without it); every zerompi
#   collective has completed by then.
ULFM_SETTINGS = {"OMPI_MCA_coll": "^han", "OMPI_MCA_async_mpi_finalize": "1"}
if _os.environ.get("OMPI_MCA_mpi_ft_enable"):
    for _name, _value in ULFM_SETTINGS.items():
        _os.environ.setdefault(_name, _value)
