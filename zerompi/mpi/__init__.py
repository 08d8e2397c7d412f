"""The MPI layer: the only place in zerompi that imports :mod:`mpi4py`.

One module per concern:

* :mod:`.collectives`: :class:`Comm`, the exact-count data path (``Reduce_scatter``,
  ``Allgatherv``, their nonblocking and prepared forms) and the small collectives
  around it;
* :mod:`.requests`: started collectives (``Pending``) and prepared ones (``Planned``);
* :mod:`.agreement`: :class:`CollectiveError`, collective validation, the running
  fingerprint of the collectives a rank makes;
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

# Launched with `mpiexec --with-ft ulfm` (zerompi.elastic): skip MPI_Finalize's closing
# PMIx fence. After a rank was lost, that fence now and then never completed here (Open
# MPI 5.0.11: 3 hangs in 88 runs, none in 60 with it skipped); every zerompi collective
# has completed by then. Set here, on `import zerompi`, before mpi4py initialises MPI.
if _os.environ.get("OMPI_MCA_mpi_ft_enable") and "OMPI_MCA_async_mpi_finalize" not in _os.environ:
    _os.environ["OMPI_MCA_async_mpi_finalize"] = "1"
