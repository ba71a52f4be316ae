#!/usr/bin/env bash
# Postgres's own regression SQL (src/test/regress of the installed major
# version, from Debian's source package), run through psql by Postgres's
# pg_regress twice, each time into a fresh cluster: straight to it, and
# through the fenceline Postgres fence (pgproxy/internal/benchproxy: a
# live whole-repo lease claiming every schema the files create, public
# included, writes of unnamed tables allowed, as --pg-allow-opaque). The
# schedule's order is kept; its parallel groups run one file at a time.
# Compares the two outputs file by file (results/NAME.out, not Postgres's
# expected files), prints the counts, and checks every file that differs
# against scripts/pg-regress-exceptions.txt (a file name and the policy
# refusal that explains it). Exits 1 when a file differs that is not
# listed, or a listed file no longer differs (the list stays true).
#
# Needs: Postgres server binaries and headers (/usr/lib/postgresql/N/bin,
# /usr/include/postgresql/N/server: regress.c, the tests' C functions, is
# built against them), the package's contrib modules (autoinc, refint),
# psql, gcc, Go, python3, and the source: PG_REGRESS_SRC (a directory with
# parallel_schedule, sql/, data/), else the cache
# ~/.cache/fenceline-pg-regress, else `apt-get source --download-only` of
# the installed postgresql-N's version (needs a deb-src line: for each
# deb822 source of a Debian mirror, a copy with Types: deb-src).
# Usage: scripts/pg-regress.sh. KEEP=1 keeps the work directory (each
# side's results/ and regression.diffs).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
BIN=$(dirname "$(ls /usr/lib/postgresql/*/bin/initdb | sort -V | tail -1)")
MAJOR=$(basename "$(dirname "$BIN")")
PGLIB=$(dirname "$BIN")/lib
PGREGRESS=$PGLIB/pgxs/src/test/regress/pg_regress
EXCEPTIONS=$ROOT/scripts/pg-regress-exceptions.txt

# --- the source: src/test/regress of the installed version.
SRC=${PG_REGRESS_SRC:-}
if [ -z "$SRC" ]; then
	ver=$(dpkg-query -W -f='${Version}' "postgresql-$MAJOR")
	upstream=${ver%%-*}
	CACHE=${XDG_CACHE_HOME:-$HOME/.cache}/fenceline-pg-regress
	SRC=$CACHE/postgresql-$upstream/src/test/regress
	if [ ! -f "$SRC/parallel_schedule" ]; then
		mkdir -p "$CACHE"
		echo "== apt-get source --download-only postgresql-$MAJOR=$ver (into $CACHE)"
		(cd "$CACHE" && apt-get source -qq --download-only "postgresql-$MAJOR=$ver" >/dev/null 2>&1) || {
			echo "apt-get source postgresql-$MAJOR=$ver failed: add a deb-src line for the Debian mirror (.ci/run does), or set PG_REGRESS_SRC" >&2
			exit 1
		}
		tar -C "$CACHE" -xjf "$CACHE/postgresql-${MAJOR}_$upstream.orig.tar.bz2" "postgresql-$upstream/src/test/regress"
	fi
fi
[ -f "$SRC/parallel_schedule" ] || { echo "no parallel_schedule in $SRC" >&2; exit 1; }

# (Not named after fenceline: the tests put the path of their C library in
# function bodies, and the fence refuses a body that mentions its schema.)
WORK=$(mktemp -d /tmp/pg-regress.XXXXXX)
RUNAS=()
if [ "$(id -u)" = 0 ]; then
	RUNAS=(setpriv --reuid=nobody --regid=nogroup --clear-groups)
fi
freeport() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
FLPID=
cleanup() {
	local rc=$?
	[ "$rc" != 0 ] && [ -s "$WORK/fl.log" ] && { echo "--- fence log (last lines)"; tail -5 "$WORK/fl.log"; } >&2
	[ -n "$FLPID" ] && kill "$FLPID" 2>/dev/null && wait "$FLPID" 2>/dev/null
	for side in direct fence; do
		"${RUNAS[@]}" "$BIN/pg_ctl" -D "$WORK/$side/data" -m immediate -w stop >/dev/null 2>&1 || true
	done
	if [ -n "${KEEP:-}" ]; then echo "kept $WORK"; else rm -rf "$WORK"; fi
}
trap cleanup EXIT
trap 'exit 143' INT TERM
# A copy the server (as nobody under root) reads the data files of.
cp -r "$SRC" "$WORK/src"
SRC=$WORK/src

# The tests' C library (regress.c) and the contrib modules they load from
# the same directory (PG_LIBDIR).
mkdir -p "$WORK/lib"
gcc -O2 -fPIC -shared -I"/usr/include/postgresql/$MAJOR/server" -o "$WORK/lib/regress.so" "$SRC/regress.c"
for m in autoinc refint; do ln -s "$PGLIB/$m.so" "$WORK/lib/$m.so"; done
go build -o "$WORK/benchproxy" ./pgproxy/internal/benchproxy

# The lease's claim: public and every schema the SQL creates (by name, by
# AUTHORIZATION role, or renamed to), each as schema.*.
CLAIMS=$(python3 - "$SRC/sql" <<'PY'
import glob, re, sys
ident = r'("(?:[^"]|"")+"|[A-Za-z_][A-Za-z_0-9$]*)'
names = {"public"}
for f in sorted(glob.glob(sys.argv[1] + "/*.sql")):
    sql = open(f, errors="replace").read()
    for m in re.finditer(r'(?is)\bcreate\s+schema\s+(?:if\s+not\s+exists\s+)?(?:authorization\s+' + ident + '|' + ident + ')', sql):
        n = m.group(1) or m.group(2)  # AUTHORIZATION role: the role's name
        if n.lower() in ("current_role", "current_user", "session_user"):
            n = "postgres"
        names.add(n)
    for m in re.finditer(r'(?is)\balter\s+schema\s+' + ident + r'\s+rename\s+to\s+' + ident, sql):
        names.add(m.group(2))
def claim(n):
    if n.startswith('"'):
        inner = n[1:-1].replace('""', '"')
        if re.fullmatch(r'[a-z_][a-z_0-9$]*', inner):
            return inner + ".*"
        return n + ".*"
    return n.lower() + ".*"
print(",".join(sorted({claim(n) for n in names})))
PY
)

start_cluster() { # side port
	mkdir -p "$WORK/$1/results"
	[ ${#RUNAS[@]} -gt 0 ] && chown -R nobody:nogroup "$WORK"
	"${RUNAS[@]}" "$BIN/initdb" -D "$WORK/$1/data" -U postgres --auth=trust --no-sync -E UTF8 --locale=C >/dev/null
	"${RUNAS[@]}" "$BIN/pg_ctl" -D "$WORK/$1/data" -l "$WORK/$1/pg.log" -w -o \
		"-p $2 -k $WORK/$1 -c listen_addresses=127.0.0.1 -c fsync=off -c max_prepared_transactions=2 -c max_connections=60" start >/dev/null
	# What pg_regress's create_database does (it skips it with --use-existing).
	"$BIN/psql" -qX -h 127.0.0.1 -p "$2" -U postgres -d postgres -v ON_ERROR_STOP=1 >/dev/null <<'SQL'
CREATE DATABASE "regression" TEMPLATE=template0;
ALTER DATABASE "regression" SET lc_messages TO 'C';
ALTER DATABASE "regression" SET lc_monetary TO 'C';
ALTER DATABASE "regression" SET lc_numeric TO 'C';
ALTER DATABASE "regression" SET lc_time TO 'C';
ALTER DATABASE "regression" SET bytea_output TO 'hex';
ALTER DATABASE "regression" SET timezone_abbreviations TO 'Default';
SQL
}

run() { # side port
	local start=$SECONDS
	# --max-connections=1: the schedule's order, one file at a time.
	(cd "$WORK/$1" && env -u PGHOST -u PGPORT -u PGUSER -u PGDATABASE -u PGOPTIONS "${RUNAS[@]}" "$PGREGRESS" \
		--use-existing --host=127.0.0.1 --port="$2" --user=postgres --dbname=regression \
		--max-connections=1 --inputdir="$SRC" --outputdir="$WORK/$1" --bindir="$BIN" \
		--dlpath="$WORK/lib" --schedule="$SRC/parallel_schedule" >"$WORK/$1/pg_regress.log" 2>&1) || true
	echo "   $1: $((SECONDS - start)) s ($(grep -cE '^(not )?ok|^test |^     [a-z]' "$WORK/$1/pg_regress.log" || true) lines of pg_regress's report)"
}

PGD=$(freeport)
PGF=$(freeport)
FLPORT=$(freeport)
echo "== postgres $("$BIN/postgres" --version | awk '{print $3}'), regression SQL of $SRC"
echo "== claim: $CLAIMS"
start_cluster direct "$PGD"
start_cluster fence "$PGF"
"$WORK/benchproxy" -listen "127.0.0.1:$FLPORT" -upstream "$WORK/fence/.s.PGSQL.$PGF" -tables "$CLAIMS" -whole-repo -allow-opaque \
	>"$WORK/fl.out" 2>"$WORK/fl.log" &
FLPID=$!
for _ in $(seq 100); do grep -q listening "$WORK/fl.out" 2>/dev/null && break; sleep 0.1; done
grep -q listening "$WORK/fl.out" || { echo "the fence did not start"; exit 1; }

echo "== direct (127.0.0.1:$PGD) and through the fence (127.0.0.1:$FLPORT), side by side"
run direct "$PGD" &
d=$!
run fence "$FLPORT" &
f=$!
wait "$d" "$f"

python3 - "$SRC/parallel_schedule" "$WORK/direct/results" "$WORK/fence/results" "$EXCEPTIONS" <<'PY'
import difflib, os, re, sys
schedule, dres, fres, exfile = sys.argv[1:]
files = [t for line in open(schedule) if line.startswith("test:") for t in line.split()[1:]]
exceptions = {}
for line in open(exfile):
    line = line.strip()
    if not line or line.startswith("#"):
        continue
    name, _, why = line.partition(":")
    exceptions[name.strip()] = why.strip()

def read(d, t):
    p = os.path.join(d, t + ".out")
    return open(p, errors="replace").read().splitlines(keepends=True) if os.path.exists(p) else None

same, differ, missing = [], [], []
for t in files:
    a, b = read(dres, t), read(fres, t)
    if a is None or b is None:
        missing.append(t)
    elif a == b:
        same.append(t)
    else:
        differ.append(t)
print("files %d: identical %d, differ %d, missing output %d" % (len(files), len(same), len(differ), len(missing)))
bad = False
for t in differ:
    if t in exceptions:
        print("  exception %-28s %s" % (t, exceptions[t]))
    else:
        bad = True
        print("  FENCE     %s (not in %s); the first lines that differ:" % (t, os.path.basename(exfile)))
        diff = list(difflib.unified_diff(read(dres, t), read(fres, t), "direct/" + t, "fence/" + t, n=1))
        sys.stdout.writelines("      " + l for l in diff[:30])
for t in missing:
    bad = True
    print("  MISSING   %s: no output on one side" % t)
stale = sorted(t for t in exceptions if t not in differ)
for t in stale:
    bad = True
    print("  STALE     %s is listed but %s" % (t, "identical: drop it from the list" if t in same else "not in the schedule"))
sys.exit(1 if bad else 0)
PY
