#!/usr/bin/env bash
# The lease bus at fleet size: for each level, starts a fresh 3-node cluster
# (R3) of the real `fenceline bus serve` binary on loopback, the nodes
# sharing one credentials directory made by `fenceline bus creds` with
# holder identities enrolled by `fenceline bus enroll`, then runs
# test/fleetbench against it: N active leases over R repos (disjoint
# paths), each holder renewing at its own cadence (TTL/3), 10 holders per
# NATS connection, the connections spread over the identities, and C
# acquire+release cycles a second of churn (Holder.Release, then
# AcquireAndHold) during the steady window.
#
#   scripts/bench-bus-cluster.sh [-l 1000,10000,50000] [-r 1000] [-d 120s]
#       [-t 30s] [-c 50] [-p 10] [-i 8] [-m DURATION] [-R 250] [-f] [-P DIR]
#       [-K SECS] [-k NODE]
#
#   -l  levels: active leases, comma-separated (default 1000,10000,50000)
#   -r  repos (default 1000)
#   -d  steady window per level, after the ramp (default 120s)
#   -t  lease TTL (default 30s; holders renew every TTL/3)
#   -c  churn: acquire+release cycles per second (default 50)
#   -p  holders per NATS connection (default 10)
#   -i  enrolled holder identities the connections are spread over (default 8)
#   -m  longest ramp: give up taking the rest of a level's leases after this
#       (default twice the level at -R a second, plus 1 min: 1,000 -> 68 s,
#       10,000 -> 140 s, 50,000 -> 460 s)
#   -R  acquires per second during the ramp (default 250)
#   -f  go on to the next level even when this one did not hold (by default a
#       level that lost leases or did not hold them all is the last)
#   -P  profile: each node serves --metrics (and pprof) on a loopback port, and
#       20 s into the steady window a 20 s CPU profile of each node is written
#       to DIR/cpu-<level>-n<i>.pprof (go tool pprof -top DIR/cpu-...), and one
#       of the driver to DIR/cpu-<level>-driver.pprof, then a heap profile of each
#       node to DIR/heap-<level>-n<i>.pprof, and again halfway through the
#       window and 30 s before it ends (DIR/heap-<level>-mid-n<i>.pprof and
#       DIR/heap-<level>-late-n<i>.pprof; windows over 90 s); the nodes' logs are kept
#       there too (DIR/node-<level>-n<i>.log), and their metrics as the
#       driver ends (DIR/metrics-<level>-n<i>.txt)
#   -K  restart: SECS into the steady window, kill -9 one node (-k: 0, 1 or 2,
#       default 0, or the node of the primary lease service instance or of a
#       standby: -k primary, -k standby; which one's was killed is printed) and start it again
#       at once on its store; prints how long until it says its lease service
#       is ready again (RESTART node=... role=... ready_s=...), while the
#       driver goes on measuring (its RSS and CPU samples of that node stop)
#
# Prints the driver's SAMPLE lines (held leases, each node's RSS and CPU
# every 5 s) and one line per level:
#   RESULT leases=… repos=… acquire_p50_ms=… acquire_p99_ms=… acquire_p999_ms=…
#     renew_p50_ms=… renew_p99_ms=… renew_p999_ms=… errors=… spurious_losses=…
#     rss_mb_max=… bytes_per_lease=… [held_end=… ramp_s=… errors_by_kind=…
#     client_msgs_per_s=… cpu_pct_nodes=… rss_mb_nI=start->end
#     acquire_p99_ms_by_node=n0/n1/n2 renew_p99_ms_by_node=…
#     echo_p50_ms=… echo_p99_ms=… echo_p999_ms=… echo_p99_ms_by_node=… …]
# acquire and renew are measured in the steady window (ramp figures follow as
# ramp_*; *_by_node splits them by the node the holder's connection is on);
# echo_* is the yardstick beside them, in the same window: a raw NATS request
# and reply through the same cluster from the same driver, no lease service on
# the way (50 a second from each node to a responder on n0); NaN means no sample. The nodes expose no monitoring port, so messages per second are counted on the driver's connections (every
# request, answer, heartbeat and notice of the holders).
#
# Everything listens on 127.0.0.1; every level is bounded in time (the
# driver by its ramp bound + -d + 3 min, the cluster's start by 3 min), and every process
# this script starts is stopped on exit, by its process id.
set -euo pipefail

levels=1000,10000,50000
repos=1000
dur=120s
ttl=30s
churn=50
perconn=10
idents=8
rampmax=
ramprate=250
force=0
profdir=
restart=
restartnode=0
while getopts "l:r:d:t:c:p:i:m:R:fP:K:k:" opt; do
  case $opt in
    l) levels=$OPTARG ;;
    r) repos=$OPTARG ;;
    d) dur=$OPTARG ;;
    t) ttl=$OPTARG ;;
    c) churn=$OPTARG ;;
    p) perconn=$OPTARG ;;
    i) idents=$OPTARG ;;
    m) rampmax=$OPTARG ;;
    R) ramprate=$OPTARG ;;
    f) force=1 ;;
    P) profdir=$(mkdir -p "$OPTARG" && cd "$OPTARG" && pwd) ;;
    K) restart=$OPTARG ;;
    k) restartnode=$OPTARG ;;
    *) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2; exit 2 ;;
  esac
done
case $levels$repos$churn$perconn$idents${ramprate%.*}$restart in *[!0-9,]*) echo "-l, -r, -c, -p, -i, -R and -K take numbers" >&2; exit 2 ;; esac
case $restartnode in 0|1|2|primary|standby) ;; *) echo "-k takes 0, 1, 2, primary or standby" >&2; exit 2 ;; esac

# seconds of a Go-style duration (90s, 2m, 1m30s): for the time bounds.
secs() {
  local d=$1 total=0 n
  while [ -n "$d" ]; do
    n=${d%%[!0-9]*}; d=${d#"$n"}
    case $d in
      h*) total=$((total + n * 3600)); d=${d#h} ;;
      ms*) d=${d#ms} ;;
      m*) total=$((total + n * 60)); d=${d#m} ;;
      s*) total=$((total + n)); d=${d#s} ;;
      *) echo "bad duration $1 (want e.g. 90s, 2m)" >&2; exit 2 ;;
    esac
  done
  echo "$total"
}

# start_node I starts node nI of the level in the background ($! is its pid),
# appending to its log.
start_node() {
  local i=$1 metrics=()
  [ -z "$profdir" ] || metrics=(--metrics "127.0.0.1:${ports[$((6 + i))]}")
  XDG_STATE_HOME=$lvl/n$i/state FENCELINE_CREDS=$creds "$bin" bus serve --name "n$i" --cluster-name fleet \
    --fence-secrets "$work/fence-secrets" --listen "127.0.0.1:${ports[$i]}" \
    --cluster-listen "127.0.0.1:${ports[$((3 + i))]}" --routes "${noderoutes[$i]}" --store "$lvl/n$i/store" "${metrics[@]}" \
    >>"$lvl/n$i.log" 2>&1 &
}
noderoutes=()

root=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
pids=()
driver=
stop_all() {
  if [ -n "$driver" ]; then kill "$driver" 2>/dev/null || true; wait "$driver" 2>/dev/null || true; driver=; fi
  local p
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do
    for _ in $(seq 100); do kill -0 "$p" 2>/dev/null || break; sleep 0.2; done
    kill -KILL "$p" 2>/dev/null || true
    wait "$p" 2>/dev/null || true
  done
  pids=()
}
trap 'stop_all; rm -rf "$work"' EXIT
trap 'exit 130' INT TERM

# Build first, so no compile runs beside a measurement.
(cd "$root" && go build -o "$work/fenceline" ./cmd/fenceline && go build -o "$work/fleetbench" ./test/fleetbench)
bin=$work/fenceline

# One credentials directory for every node, as docs/bus.md says a cluster
# shares one; the holders' identities enrolled before the nodes start (each
# node reads them at start). --nats points nowhere so enroll asks no running
# bus to reload.
creds=$work/creds
"$bin" bus creds --dir "$creds" >/dev/null 2>&1
ids=
for i in $(seq 0 $((idents - 1))); do
  "$bin" --nats nats://127.0.0.1:1 bus enroll "fleet-$i" --dir "$creds" >/dev/null 2>&1
  ids=${ids:+$ids,}fleet-$i
done
mkdir -m 0700 "$work/fence-secrets"

echo "== fleetbench: levels $levels, $repos repos, steady $dur, ttl $ttl, churn $churn/s, $perconn holders per connection, $idents identities; $(nproc) cores, $(uptime | sed 's/.*load/load/')"
results=$work/results.txt
: >"$results"
for n in ${levels//,/ }; do
  lvl=$work/level-$n
  mkdir -p "$lvl"
  read -r -a ports <<<"$("$work/fleetbench" ports 10)"
  urls=
  nodes=
  for i in 0 1 2; do
    routes=
    for j in 0 1 2; do [ "$j" = "$i" ] || routes=${routes:+$routes,}nats://127.0.0.1:${ports[$((3 + j))]}; done
    mkdir -p "$lvl/n$i/state"
    noderoutes[$i]=$routes
    start_node "$i"
    pids+=($!)
    urls=${urls:+$urls,}nats://127.0.0.1:${ports[$i]}
    nodes=${nodes:+$nodes,}n$i=$!
  done
  echo "== level $n: cluster starting ($nodes)"
  t0=$SECONDS
  up=0
  while [ $((SECONDS - t0)) -lt 180 ]; do
    up=0
    for i in 0 1 2; do
      grep -q "lease service ready" "$lvl/n$i.log" && up=$((up + 1))
      kill -0 "${pids[$i]}" 2>/dev/null || { echo "node n$i exited while starting:"; tail -20 "$lvl/n$i.log"; break 2; }
    done
    [ "$up" = 3 ] && break
    sleep 0.5
  done
  if [ "$up" != 3 ]; then
    echo "RESULT leases=$n repos=$repos error=cluster_not_ready ready_nodes=$up" | tee -a "$results"
    for i in 0 1 2; do echo "-- n$i:"; tail -5 "$lvl/n$i.log"; done
    stop_all
    break
  fi
  echo "== level $n: cluster ready after $((SECONDS - t0)) s"
  if [ -n "$rampmax" ]; then ramp=$(secs "$rampmax"); else ramp=$(( 2 * n / ${ramprate%.*} + 60 )); fi
  bound=$(( ramp + $(secs "$dur") + 180 ))
  : >"$lvl/driver.log" # before the tail below follows it
  timeout -k 15 "$bound" "$work/fleetbench" -urls "$urls" -creds "$creds" -identities "$ids" -nodes "$nodes" \
    -leases "$n" -repos "$repos" -ttl "$ttl" -churn "$churn" -d "$dur" -per-conn "$perconn" \
    -ramp-max "${ramp}s" -ramp-rate "$ramprate" ${profdir:+-pprof "127.0.0.1:${ports[9]}"} >"$lvl/driver.log" 2>&1 &
  driver=$!
  tail -f --pid="$driver" "$lvl/driver.log" &
  tailer=$!
  if [ -n "$profdir" ]; then
    # 20 s into the steady window (the driver prints "ramp: ..." when it
    # begins), a 20 s CPU profile of each node, all three at once.
    (
      while kill -0 "$driver" 2>/dev/null && ! grep -q '^ramp: ' "$lvl/driver.log"; do sleep 1; done
      sleep 20
      for i in 0 1 2; do
        curl -sf -m 40 -o "$profdir/cpu-$n-n$i.pprof" "http://127.0.0.1:${ports[$((6 + i))]}/debug/pprof/profile?seconds=20" &
      done
      curl -sf -m 40 -o "$profdir/cpu-$n-driver.pprof" "http://127.0.0.1:${ports[9]}/debug/pprof/profile?seconds=20" &
      wait
      # and what each node's heap holds then (go tool pprof -sample_index=inuse_space -top)
      for i in 0 1 2; do
        curl -sf -m 40 -o "$profdir/heap-$n-n$i.pprof" "http://127.0.0.1:${ports[$((6 + i))]}/debug/pprof/heap" &
      done
      wait
    ) &
    # and again halfway through the window and 30 s before it ends
    # (heap-<level>-mid-n<i>.pprof, heap-<level>-late-n<i>.pprof): what grew
    # in between (go tool pprof -base heap-...-mid-... heap-...-late-...)
    (
      while kill -0 "$driver" 2>/dev/null && ! grep -q '^ramp: ' "$lvl/driver.log"; do sleep 1; done
      mid=$(( $(secs "$dur") / 2 ))
      late=$(( $(secs "$dur") - 30 ))
      if [ "$late" -gt 60 ]; then
        sleep "$mid"
        for i in 0 1 2; do
          curl -sf -m 40 -o "$profdir/heap-$n-mid-n$i.pprof" "http://127.0.0.1:${ports[$((6 + i))]}/debug/pprof/heap" &
        done
        wait
        sleep $(( late - mid ))
        for i in 0 1 2; do
          curl -sf -m 40 -o "$profdir/heap-$n-late-n$i.pprof" "http://127.0.0.1:${ports[$((6 + i))]}/debug/pprof/heap" &
        done
        wait
      fi
    ) &
  fi
  if [ -n "$restart" ]; then
    # -K: kill -9 a node SECS into the steady window, start it again at
    # once, and time it back to serving. Its new pid replaces the old one
    # for stop_all.
    (
      while kill -0 "$driver" 2>/dev/null && ! grep -q '^ramp: ' "$lvl/driver.log"; do sleep 1; done
      sleep "$restart"
      is_primary() { grep -E 'is the primary: it serves|no longer the primary' "$lvl/n$1.log" | tail -1 | grep -q 'is the primary'; }
      case $restartnode in
        primary|standby)
          k=
          for i in 0 1 2; do
            if is_primary "$i"; then p=primary; else p=standby; fi
            if [ "$p" = "$restartnode" ] && [ -z "$k" ]; then k=$i; fi
          done
          k=${k:-0} ;;
        *) k=$restartnode ;;
      esac
      role=standby
      if is_primary "$k"; then role=primary; fi
      readies=$(grep -c 'lease service ready' "$lvl/n$k.log" || true)
      kill -KILL "${pids[$k]}" 2>/dev/null || true
      t=$(date +%s.%N)
      # (not this shell's child: wait until it is gone, and its ports free —
      # a killed process is a zombie once its first thread is gone, while
      # others may still be finishing a write to the store and holding its
      # listening sockets)
      while kill -0 "${pids[$k]}" 2>/dev/null && [ "$(cut -d' ' -f3 "/proc/${pids[$k]}/stat" 2>/dev/null)" != Z ]; do sleep 0.05; done
      for _ in $(seq 600); do
        [ -n "$(ss -Hltn "( sport = :${ports[$k]} or sport = :${ports[$((3 + k))]} )" 2>/dev/null)" ] || break
        sleep 0.05
      done
      start_node "$k"
      echo "$k $!" >"$lvl/restarted.pid"
      echo "== restart: killed n$k ($role) with -9 and started it again"
      ready=
      while kill -0 "$driver" 2>/dev/null; do
        if [ "$(grep -c 'lease service ready' "$lvl/n$k.log" || true)" -gt "$readies" ]; then ready=$(awk -v a="$t" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }'); break; fi
        sleep 0.1
      done
      echo "RESTART node=n$k role=$role ready_s=${ready:-not_while_measured}" | tee -a "$lvl/restart.txt"
    ) &
    restarter=$!
  fi
  rc=0
  wait "$driver" || rc=$?
  if [ -n "$profdir" ]; then
    # what each node's metrics say at the end (request and append latency
    # histograms by operation, beats, forwarded calls)
    for i in 0 1 2; do
      curl -sf -m 10 -o "$profdir/metrics-$n-n$i.txt" "http://127.0.0.1:${ports[$((6 + i))]}/metrics" || true
    done
  fi
  if [ -n "$restart" ]; then wait "$restarter" 2>/dev/null || true; fi
  if [ -f "$lvl/restarted.pid" ]; then read -r k pid <"$lvl/restarted.pid"; pids[$k]=$pid; fi
  driver=
  wait "$tailer" 2>/dev/null || true
  line=$(grep '^RESULT ' "$lvl/driver.log" || true)
  if [ -z "$line" ]; then
    line="RESULT leases=$n repos=$repos error=driver_exit_$rc"
    tail -5 "$lvl/driver.log"
  fi
  echo "$line" >>"$results"
  [ ! -f "$lvl/restart.txt" ] || cat "$lvl/restart.txt" >>"$results"
  for i in 0 1 2; do
    echo "node n$i: $(grep -cE 'level=(ERROR|WARN)' "$lvl/n$i.log" || true) warnings and errors logged; most frequent:"
    grep -E 'level=(ERROR|WARN)' "$lvl/n$i.log" | grep -oE 'msg=("[^"]*"|[^ ]*)' | sort | uniq -c | sort -rn | head -4 || true
  done
  stop_all
  if [ -n "$profdir" ]; then for i in 0 1 2; do cp "$lvl/n$i.log" "$profdir/node-$n-n$i.log"; done; fi
  rm -rf "$lvl"
  held=$(sed -n 's/.* held_end=\([0-9]*\).*/\1/p' <<<"$line")
  lost=$(sed -n 's/.* spurious_losses=\([0-9]*\).*/\1/p' <<<"$line")
  if [ "$force" = 0 ] && { [ "${held:-0}" -lt $((n * 99 / 100)) ] || [ "${lost:-1}" -gt 0 ]; }; then
    echo "== level $n did not hold (held_end below 99%: =${held:-?} of $n, spurious_losses=${lost:-?}): stopping here (-f goes on)"
    break
  fi
done
echo
echo "== results"
cat "$results"
