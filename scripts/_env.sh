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
