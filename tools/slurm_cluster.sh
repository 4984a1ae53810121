#!/usr/bin/env bash
# tools/slurm_cluster.sh -- a real multi-node Slurm 22.05 cluster on ONE machine, for tests.
#
#   sudo tools/slurm_cluster.sh up       # install (if needed) + start; waits until all nodes are idle
#   sudo tools/slurm_cluster.sh status   # sinfo + daemon PIDs
#   sudo tools/slurm_cluster.sh down     # stop everything, remove namespaces/bridge/hosts block
#
# Each node is a network namespace (veth into a private bridge, own 10.77.0.x address, no
# default route) plus a UTS namespace whose hostname is the node name, running a plain
# `slurmd -N nodeN`. slurmctld runs on the host in its own UTS namespace (hostname prl-ctl)
# and listens on the bridge address. The filesystem is shared by all nodes.
# See docs/slurm-test-cluster.md for details, measured timings and pitfalls.
#
# Environment (all optional):
#   PRL_SLURM_NODES      number of nodes (default 5; names node1..nodeN, max 200)
#   PRL_SLURM_STATE      state directory (default /var/lib/prl-slurm); wiped by `up`
#   PRL_SLURM_CPUS       CPUs per node (default 4)
#   PRL_SLURM_GPUS       fake GPUs per node (default 2; 0 disables GRES); `real`: the machine's
#                        /dev/nvidiaN, split evenly between the gpu nodes (a GPU machine)
#   PRL_SLURM_DEBS       a folder of Debian 12 .deb files (tools/fetch_slurm_debs.sh) to unpack with
#                        dpkg -x instead of installing packages (a machine without a package registry)
#   PRL_SLURM_CPU_NODES  the last N nodes have no GPUs and form partition `cpu`; the others form
#                        partition `gpu` (default 1; 0 with one node). `debug` (default) has all.
#   PRL_SLURM_MEM_MB     RealMemory per node in MB (default 8192)
#   PRL_SLURM_TIMEOUT    seconds `up` waits for all nodes to be idle (default 60)
#   PRL_SLURM_EXTRA_CONF extra lines appended to slurm.conf (later keys win)
set -euo pipefail

STATE="${PRL_SLURM_STATE:-/var/lib/prl-slurm}"
NODES="${PRL_SLURM_NODES:-5}"
CPUS="${PRL_SLURM_CPUS:-4}"
GPUS="${PRL_SLURM_GPUS:-2}"
DEBS="${PRL_SLURM_DEBS:-}"
CPU_NODES="${PRL_SLURM_CPU_NODES:-$(( ${PRL_SLURM_NODES:-5} > 1 ? 1 : 0 ))}"
MEM_MB="${PRL_SLURM_MEM_MB:-8192}"
TIMEOUT="${PRL_SLURM_TIMEOUT:-60}"
EXTRA_CONF="${PRL_SLURM_EXTRA_CONF:-}"

BRIDGE=prlbr0
NET=10.77.0
CTL_IP="$NET.1"
CTL_NAME=prl-ctl
NS_PREFIX=prl-
VETH_PREFIX=prlv
ETC=/etc/slurm
CONF="$ETC/slurm.conf"
GRES_CONF="$ETC/gres.conf"
CGROUP_CONF="$ETC/cgroup.conf"
MARK="PRL-SLURM-TEST-CLUSTER"          # marker in every file/block we own
HOSTS_BEGIN="# BEGIN $MARK (tools/slurm_cluster.sh; removed by 'down')"
HOSTS_END="# END $MARK"
LOCK=/run/prl-slurm.lock
SBIN=/usr/sbin
MUNGE_SOCK=/run/munge/munge.socket.2
PKG=/opt/prl-slurm                      # PRL_SLURM_DEBS: the packages, unpacked
CLIENTS=(sbatch srun salloc squeue scontrol scancel sinfo sacct munge unmunge)
REAL_GPUS=0
if [[ $GPUS == real ]]; then REAL_GPUS=1; fi

log() { printf '[slurm_cluster] %s\n' "$*" >&2; }
die() { printf '[slurm_cluster] ERROR: %s\n' "$*" >&2; exit 1; }

node_name() { echo "node$1"; }
node_ip() { echo "$NET.$((10 + $1))"; }
node_ns() { echo "${NS_PREFIX}node$1"; }

# ---------------------------------------------------------------- checks / install
check_args() {
  [[ "$NODES" =~ ^[0-9]+$ ]] && ((NODES >= 1 && NODES <= 200)) || die "PRL_SLURM_NODES must be 1..200"
  [[ "$CPUS" =~ ^[0-9]+$ ]] && ((CPUS >= 1)) || die "PRL_SLURM_CPUS must be >= 1"
  if ((REAL_GPUS)); then
    local found gpu_nodes=$((NODES - CPU_NODES))
    found=$(real_gpu_count)
    ((found > 0)) || die "PRL_SLURM_GPUS=real but this machine has no /dev/nvidiaN"
    ((found % gpu_nodes == 0)) || die "PRL_SLURM_GPUS=real: $found GPUs do not split evenly between $gpu_nodes gpu nodes"
    GPUS=$((found / gpu_nodes))
  fi
  [[ "$GPUS" =~ ^[0-9]+$ ]] || die "PRL_SLURM_GPUS must be >= 0 or real"
  [[ -z "$DEBS" || -d "$DEBS" ]] || die "PRL_SLURM_DEBS: no folder $DEBS"
  [[ "$CPU_NODES" =~ ^[0-9]+$ ]] && ((CPU_NODES < NODES)) || die "PRL_SLURM_CPU_NODES must be 0..PRL_SLURM_NODES-1"
  [[ "$MEM_MB" =~ ^[0-9]+$ ]] && ((MEM_MB >= 256)) || die "PRL_SLURM_MEM_MB must be >= 256"
  [[ "$STATE" == /* && "$STATE" != "/" ]] || die "PRL_SLURM_STATE must be an absolute path (not /)"
}

real_gpu_count() { local n=0 d; for d in /dev/nvidia[0-9]*; do [[ -c $d ]] && n=$((n + 1)); done; echo $n; }

need_root() { [[ $(id -u) -eq 0 ]] || die "must run as root"; }

unpack_debs() {
  # The GPU machines: Debian 12's packages unpacked (no dpkg database, no package scripts). Daemons
  # and libraries are found through SBIN, LD_LIBRARY_PATH and PluginDir; the client commands get
  # wrappers in /usr/local/bin (marked, removed by `down`) so that every shell and job finds them.
  local deb lib=$PKG/usr/lib/x86_64-linux-gnu b stamp
  stamp=$(cd "$DEBS" && sha256sum ./*.deb ./iproute2/*.deb 2>/dev/null) || [[ -n $stamp ]] || die "PRL_SLURM_DEBS: no .deb files in $DEBS"
  if [[ "$(cat "$PKG/.debs" 2>/dev/null)" != "$stamp" ]]; then  # never under running daemons
    is_up && die "the cluster runs from other packages in $PKG: run 'down' first"
    rm -rf "$PKG" && mkdir -p "$PKG"
    for deb in "$DEBS"/*.deb; do dpkg -x "$deb" "$PKG"; done
    for deb in "$DEBS"/iproute2/*.deb; do [[ -f $deb ]] && dpkg -x "$deb" "$PKG/net"; done
    echo "$stamp" >"$PKG/.debs"
  fi
  for b in slurmd slurmstepd slurmctld; do  # Debian names the daemons *-wlm (alternatives)
    [[ -x $PKG/usr/sbin/$b ]] || ln -sf "$PKG/usr/sbin/$b-wlm" "$PKG/usr/sbin/$b"
  done
  id munge >/dev/null 2>&1 || useradd --system --no-create-home --shell /usr/sbin/nologin munge
}

use_debs() { # daemons from the unpacked packages
  local lib=$PKG/usr/lib/x86_64-linux-gnu
  SBIN=$PKG/usr/sbin
  export LD_LIBRARY_PATH=$lib:$lib/slurm-wlm:$PKG/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  export PATH=/usr/local/bin:$PATH
  if ! command -v ip >/dev/null && [[ -d $PKG/net ]]; then  # this tool's own `ip`, with its own libraries
    ip() {
      local net=$PKG/net
      LD_LIBRARY_PATH=$net/usr/lib/x86_64-linux-gnu:$net/lib/x86_64-linux-gnu "$(ls $net/bin/ip $net/sbin/ip $net/usr/bin/ip $net/usr/sbin/ip 2>/dev/null | head -1)" "$@"
    }
  fi
}

install_wrappers() { # after `down` (which removes them), before anything runs a client command
  local b bin lib=$PKG/usr/lib/x86_64-linux-gnu
  [[ -n $DEBS ]] || return 0
  # slurmd starts slurmstepd by its built-in path
  [[ -e /usr/sbin/slurmstepd ]] || ln -s "$PKG/usr/sbin/slurmstepd" /usr/sbin/slurmstepd
  for b in "${CLIENTS[@]}"; do
    bin=$PKG/usr/bin/$b
    [[ -x $bin ]] || bin=$PKG/usr/sbin/$b
    printf '#!/bin/sh\n# %s\nLD_LIBRARY_PATH=%s${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} exec %s "$@"\n' \
      "$MARK" "$lib:$lib/slurm-wlm:$PKG/lib/x86_64-linux-gnu" "$bin" >"/usr/local/bin/$b"
    chmod 755 "/usr/local/bin/$b"
  done
}

remove_wrappers() {
  local b
  for b in "${CLIENTS[@]}"; do
    grep -qs "$MARK" "/usr/local/bin/$b" && rm -f "/usr/local/bin/$b"
  done
  if [[ -L /usr/sbin/slurmstepd && "$(readlink /usr/sbin/slurmstepd)" == "$PKG"/* ]]; then rm -f /usr/sbin/slurmstepd; fi
  return 0
}

ensure_packages() {
  if [[ -n $DEBS ]]; then
    unpack_debs
    use_debs
    return 0
  fi
  local missing=()
  [[ -x $SBIN/slurmctld ]] || missing+=(slurmctld)
  [[ -x $SBIN/slurmd ]] || missing+=(slurmd)
  command -v sbatch >/dev/null || missing+=(slurm-client)
  [[ -x $SBIN/munged ]] && command -v munge >/dev/null || missing+=(munge)
  command -v ip >/dev/null || missing+=(iproute2)
  command -v nsenter >/dev/null && command -v unshare >/dev/null || missing+=(util-linux)
  ((${#missing[@]})) || return 0
  log "installing: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  # Do not let the packages' postinst start their own daemons (they'd fight ours).
  local policy=/usr/sbin/policy-rc.d made_policy=0
  if [[ ! -e $policy ]]; then
    printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod 755 "$policy" && made_policy=1
  fi
  local apt=(apt-get -o DPkg::Lock::Timeout=300 -y)
  if ! "${apt[@]}" install --no-install-recommends "${missing[@]}"; then
    log "apt-get install failed; running apt-get update and retrying"
    "${apt[@]}" update && "${apt[@]}" install --no-install-recommends "${missing[@]}" ||
      { ((made_policy)) && rm -f "$policy"; die "could not install ${missing[*]}"; }
  fi
  ((made_policy)) && rm -f "$policy"
  # On a systemd machine, make sure the distro units are not running alongside ours.
  if [[ -d /run/systemd/system ]] && command -v systemctl >/dev/null; then
    systemctl stop slurmctld.service slurmd.service 2>/dev/null || true
  fi
  return 0
}

# ---------------------------------------------------------------- PIDs
# pid files in $STATE/pids/<name>: "<pid> <comm>"
record_pid() { mkdir -p "$STATE/pids"; echo "$2 $3" >"$STATE/pids/$1"; }

pid_alive() { # pid comm -- true if running (zombies count as dead: PID 1 may reap slowly)
  local stat st
  [[ -n "$1" ]] && read -r stat 2>/dev/null <"/proc/$1/stat" || return 1
  st=${stat##*) }
  [[ ${st%% *} != Z ]] || return 1
  [[ "$(cat "/proc/$1/comm" 2>/dev/null)" == "$2"* ]]
}

any_alive() { # pid comm [pid comm ...] -- true if any of them is running
  while (($#)); do
    pid_alive "$1" "$2" && return 0
    shift 2
  done
  return 1
}

read_pidfile() { # file -> pid (waits up to 10 s for it to appear)
  local f=$1 i
  for ((i = 0; i < 100; i++)); do
    [[ -s "$f" ]] && { tr -dc '0-9' <"$f"; return 0; }
    sleep 0.1
  done
  return 1
}

stop_pids() { # grace_s pid comm [pid comm ...] -- TERM all, wait, then KILL stragglers
  local grace=$1 i
  shift
  local -a l=("$@")
  for ((i = 0; i < ${#l[@]}; i += 2)); do
    pid_alive "${l[i]}" "${l[i + 1]}" && kill -TERM "${l[i]}" 2>/dev/null || true
  done
  for ((i = 0; i < grace * 20; i++)); do
    any_alive "${l[@]}" || return 0
    sleep 0.05
  done
  for ((i = 0; i < ${#l[@]}; i += 2)); do
    if pid_alive "${l[i]}" "${l[i + 1]}"; then
      log "${l[i + 1]} (${l[i]}) did not exit on TERM within ${grace}s; sending KILL"
      kill -KILL "${l[i]}" 2>/dev/null || true
    fi
  done
  for ((i = 0; i < 40; i++)); do any_alive "${l[@]}" || return 0; sleep 0.05; done
}

ns_pids() { # live (non-zombie) PIDs in the node network namespaces
  local ns p stat st
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^${NS_PREFIX}node[0-9]+$" || true); do
    for p in $(ip netns pids "$ns" 2>/dev/null); do
      read -r stat 2>/dev/null <"/proc/$p/stat" || continue
      st=${stat##*) }
      [[ ${st%% *} == Z ]] || echo "$p"
    done
  done
}

# ---------------------------------------------------------------- munge
munge_works() { [[ -S $MUNGE_SOCK ]] && munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }

start_munge() {
  if [[ -s "$STATE/pids/munged" ]]; then
    read -r p c <"$STATE/pids/munged"
    pid_alive "$p" "$c" && munge_works && return 0
  fi
  if munge_works; then
    log "using the munged that is already running (not ours; 'down' leaves it alone)"
    rm -f "$STATE/pids/munged"
    return 0
  fi
  if [[ ! -s /etc/munge/munge.key ]]; then
    log "creating /etc/munge/munge.key"
    mkdir -p /etc/munge
    if command -v mungekey >/dev/null; then
      mungekey --create --keyfile=/etc/munge/munge.key
    else
      dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
    fi
  fi
  chown munge:munge /etc/munge /etc/munge/munge.key
  chmod 700 /etc/munge
  chmod 400 /etc/munge/munge.key
  install -d -o munge -g munge -m 755 /run/munge
  install -d -o munge -g munge -m 700 /var/lib/munge /var/log/munge
  rm -f /run/munge/munged.pid
  # --force: the unpacked munged would otherwise refuse paths the image did not set up as Debian does
  setsid runuser -u munge -- $SBIN/munged ${DEBS:+--force} 9>&- </dev/null >>"$STATE/log/munged.out" 2>&1 ||
    die "munged failed to start: $(tail -5 /var/log/munge/munged.log 2>/dev/null)"
  local pid
  pid=$(read_pidfile /run/munge/munged.pid) || die "munged wrote no pid file"
  record_pid munged "$pid" munged
  local i
  for ((i = 0; i < 50; i++)); do munge_works && return 0; sleep 0.1; done
  die "munged (pid $pid) does not answer: $(tail -5 /var/log/munge/munged.log 2>/dev/null)"
}

# ---------------------------------------------------------------- config
write_configs() {
  # node1..node$gpu_nodes: partition gpu, with GRES; the rest: partition cpu, without.
  local i gres_line="" gpu_nodes=$((NODES - CPU_NODES))
  local nodes_expr="node[1-$gpu_nodes]" cpu_expr="node[$((gpu_nodes + 1))-$NODES]"
  ((gpu_nodes == 1)) && nodes_expr=node1
  ((CPU_NODES == 1)) && cpu_expr="node$NODES"
  for f in "$CONF" "$GRES_CONF"; do
    if [[ -e $f ]] && ! grep -q "$MARK" "$f"; then
      die "$f exists and was not written by this tool; move it away first"
    fi
  done
  mkdir -p "$ETC"
  write_cgroup_conf
  ((GPUS > 0)) && gres_line=" Gres=gpu:$GPUS"
  {
    echo "# $MARK: generated by tools/slurm_cluster.sh on $(date -Is); removed by 'down'"
    cat <<EOF
ClusterName=prl
SlurmctldHost=$CTL_NAME($CTL_IP)
SlurmUser=root
SlurmdUser=root
${DEBS:+PluginDir=$PKG/usr/lib/x86_64-linux-gnu/slurm-wlm}
SlurmctldPort=6817
SlurmdPort=6818
AuthType=auth/munge
CredType=cred/munge
# A requeued job cannot start again before cred_expire+1 s; 5 is the minimum 22.05 accepts.
AuthInfo=cred_expire=5
StateSaveLocation=$STATE/ctld
SlurmctldPidFile=$STATE/run/slurmctld.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmctldDebug=info
SlurmdSpoolDir=$STATE/spool/%n
SlurmdPidFile=$STATE/run/slurmd-%n.pid
SlurmdLogFile=$STATE/log/slurmd-%n.log
SlurmdDebug=info
# Declared CPUs/GPUs/memory may exceed the real machine.
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$STATE/log/jobcomp.log
MpiDefault=none
SwitchType=switch/none
# Heterogeneous jobs need the backfill scheduler.
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,sched_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=256
ReturnToService=1
JobRequeue=1
KillWait=2
MessageTimeout=5
MinJobAge=5
InactiveLimit=0
Waittime=0
SlurmdTimeout=30
SlurmctldTimeout=30
UnkillableStepTimeout=30
MailProg=/bin/true
EOF
    if ((GPUS > 0)); then echo "GresTypes=gpu"; fi
    for ((i = 1; i <= NODES; i++)); do
      ((i <= gpu_nodes)) || gres_line=""
      echo "NodeName=$(node_name $i) NodeAddr=$(node_ip $i) CPUs=$CPUS Sockets=1 CoresPerSocket=$CPUS ThreadsPerCore=1 RealMemory=$MEM_MB$gres_line State=UNKNOWN"
    done
    echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP"
    echo "PartitionName=gpu Nodes=$nodes_expr MaxTime=INFINITE State=UP"
    if ((CPU_NODES > 0)); then echo "PartitionName=cpu Nodes=$cpu_expr MaxTime=INFINITE State=UP"; fi
    # Real GPUs shared by namespace "nodes" of one machine: SLURM numbers a step's GPUs from 0 on
    # every node (CUDA_VISIBLE_DEVICES=0 on node2 too), right on a real node but here GPU 0 of the
    # machine. The task prolog gives each task the machine's numbers of its GPUs (SLURM_STEP_GPUS).
    if ((REAL_GPUS)); then echo "TaskProlog=$STATE/task_prolog.sh"; fi
    if [[ -n "$EXTRA_CONF" ]]; then printf '%s\n' "$EXTRA_CONF"; fi
  } >"$CONF.tmp"
  if ((REAL_GPUS)); then write_task_prolog "$gpu_nodes"; fi
  chmod 644 "$CONF.tmp"
  mv -f "$CONF.tmp" "$CONF"
  if ((GPUS > 0 && REAL_GPUS)); then
    {
      echo "# $MARK: generated by tools/slurm_cluster.sh; removed by 'down'"
      # node i gets the machine's GPUs (i-1)*GPUS .. i*GPUS-1; CUDA_VISIBLE_DEVICES binds them
      for ((i = 1; i <= gpu_nodes; i++)); do
        local first=$(((i - 1) * GPUS)) last=$((i * GPUS - 1))
        if ((first == last)); then echo "NodeName=$(node_name $i) Name=gpu File=/dev/nvidia$first"
        else echo "NodeName=$(node_name $i) Name=gpu File=/dev/nvidia[$first-$last]"; fi
      done
    } >"$GRES_CONF"
    chmod 644 "$GRES_CONF"
  elif ((GPUS > 0)); then
    {
      echo "# $MARK: generated by tools/slurm_cluster.sh; removed by 'down'"
      if ((GPUS == 1)); then
        echo "NodeName=$nodes_expr Name=gpu File=$STATE/dev/nvidia0"
      else
        echo "NodeName=$nodes_expr Name=gpu File=$STATE/dev/nvidia[0-$((GPUS - 1))]"
      fi
    } >"$GRES_CONF"
    chmod 644 "$GRES_CONF"
    # GRES File= must be character devices (regular files / no File= do not work).
    for ((i = 0; i < GPUS; i++)); do
      [[ -c "$STATE/dev/nvidia$i" ]] || mknod -m 666 "$STATE/dev/nvidia$i" c 195 "$i"
    done
  else
    rm -f "$GRES_CONF"
  fi
}

write_task_prolog() { # gpu_nodes -- CUDA_VISIBLE_DEVICES from the node's indices to the machine's
  # SLURM writes a step's GPUs as indices among its node's GPUs (0,1 on node2 of 2 GPUs each); node i
  # holds the machine's GPUs (i-1)*GPUS.. (gres.conf), so each index is shifted by that node's first.
  local i
  {
    printf '#!/bin/bash\n# %s: the machine'"'"'s numbers of the task'"'"'s GPUs (written by tools/slurm_cluster.sh)\n' "$MARK"
    printf 'case "$SLURMD_NODENAME" in\n'
    for ((i = 1; i <= $1; i++)); do printf '  %s) first=%d ;;\n' "$(node_name $i)" $(((i - 1) * GPUS)); done
    printf '  *) exit 0 ;;\nesac\n'
    printf '[ -n "${CUDA_VISIBLE_DEVICES:-}" ] || exit 0\n'
    printf 'out=""; for g in ${CUDA_VISIBLE_DEVICES//,/ }; do out+="${out:+,}$((g + first))"; done\n'
    printf 'echo "export CUDA_VISIBLE_DEVICES=$out"\n'
  } >"$STATE/task_prolog.sh"
  chmod 755 "$STATE/task_prolog.sh"
}

write_cgroup_conf() {
  # slurmd 22.05 always loads a cgroup plugin. Where /sys/fs/cgroup is cgroup v2 only and no
  # systemd runs (the GPU machines' containers), the v2 plugin needs IgnoreSystemd and a
  # system.slice to create its own cgroup in; elsewhere Slurm's defaults work and nothing is written.
  if [[ "$(stat -fc %T /sys/fs/cgroup 2>/dev/null)" != cgroup2fs || -d /run/systemd/system ]]; then
    return 0
  fi
  if [[ -e $CGROUP_CONF ]] && ! grep -q "$MARK" "$CGROUP_CONF"; then
    die "$CGROUP_CONF exists and was not written by this tool; move it away first"
  fi
  printf '# %s\nCgroupPlugin=cgroup/v2\nIgnoreSystemd=yes\n' "$MARK" >"$CGROUP_CONF"
  mkdir -p /sys/fs/cgroup/system.slice
  # slurmd checks that cpuset, cpu and memory reach its cgroup: hand every available controller down
  local c
  for c in $(cat /sys/fs/cgroup/cgroup.controllers); do
    echo "+$c" >/sys/fs/cgroup/cgroup.subtree_control 2>/dev/null || true
    echo "+$c" >/sys/fs/cgroup/system.slice/cgroup.subtree_control 2>/dev/null || true
  done
}

# ---------------------------------------------------------------- /etc/hosts
hosts_remove() {
  grep -qF "$HOSTS_BEGIN" /etc/hosts 2>/dev/null || return 0
  local tmp
  tmp=$(mktemp)
  awk -v b="$HOSTS_BEGIN" -v e="$HOSTS_END" '$0==b{skip=1;next} skip&&$0==e{skip=0;next} !skip' /etc/hosts >"$tmp"
  cat "$tmp" >/etc/hosts # in place: /etc/hosts may be a bind mount
  rm -f "$tmp"
}

hosts_add() {
  hosts_remove
  local i
  if [[ -s /etc/hosts && -n "$(tail -c1 /etc/hosts)" ]]; then echo >>/etc/hosts; fi
  {
    echo "$HOSTS_BEGIN"
    echo "$CTL_IP $CTL_NAME"
    for ((i = 1; i <= NODES; i++)); do echo "$(node_ip $i) $(node_name $i)"; done
    echo "$HOSTS_END"
  } >>/etc/hosts
}

# ---------------------------------------------------------------- network
net_up() {
  ip link show "$BRIDGE" >/dev/null 2>&1 || ip link add "$BRIDGE" type bridge
  ip addr replace "$CTL_IP/24" dev "$BRIDGE"
  ip link set "$BRIDGE" up
  local i ns veth
  for ((i = 1; i <= NODES; i++)); do
    ns=$(node_ns $i)
    veth="$VETH_PREFIX$i"
    ip netns add "$ns"
    ip link add "$veth" type veth peer name eth0 netns "$ns"
    ip link set "$veth" master "$BRIDGE" up
    ip -n "$ns" link set lo up
    ip -n "$ns" addr add "$(node_ip $i)/24" dev eth0
    ip -n "$ns" link set eth0 up
  done
}

net_down() {
  local ns i
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^${NS_PREFIX}node[0-9]+$" || true); do
    ip netns del "$ns" 2>/dev/null || true
  done
  for i in $(ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | sed 's/@.*//' | grep -E "^${VETH_PREFIX}[0-9]+$" || true); do
    ip link del "$i" 2>/dev/null || true
  done
  ip link show "$BRIDGE" >/dev/null 2>&1 && ip link del "$BRIDGE" || true
}

# ---------------------------------------------------------------- daemons
start_slurmctld() {
  rm -f "$STATE/run/slurmctld.pid"
  # Own UTS namespace so gethostname() == SlurmctldHost; host network namespace.
  setsid unshare --uts -- /bin/sh -c "echo $CTL_NAME >/proc/sys/kernel/hostname && exec $SBIN/slurmctld" \
    9>&- </dev/null >>"$STATE/log/slurmctld.out" 2>&1 || fail_logs "slurmctld failed to start"
  local pid
  pid=$(read_pidfile "$STATE/run/slurmctld.pid") || fail_logs "slurmctld did not start"
  record_pid slurmctld "$pid" slurmctld
  local i
  for ((i = 0; i < 100; i++)); do
    scontrol ping 2>/dev/null | grep -q 'is UP' && return 0
    pid_alive "$pid" slurmctld || fail_logs "slurmctld exited"
    sleep 0.1
  done
  fail_logs "slurmctld does not answer scontrol ping"
}

start_slurmd() { # index
  local i=$1 n ns
  n=$(node_name "$i")
  ns=$(node_ns "$i")
  rm -f "$STATE/run/slurmd-$n.pid"
  mkdir -p "$STATE/spool/$n"
  # NOT `ip netns exec`: it remounts /sys, hiding /sys/fs/cgroup, and slurmd 22.05 refuses to start.
  setsid nsenter --net="/run/netns/$ns" -- unshare --uts -- \
    /bin/sh -c "echo $n >/proc/sys/kernel/hostname && exec $SBIN/slurmd -N $n" \
    9>&- </dev/null >>"$STATE/log/slurmd-$n.out" 2>&1 || fail_logs "slurmd on $n failed to start"
}

fail_logs() {
  local f
  printf '[slurm_cluster] ERROR: %s\n' "$1" >&2
  for f in "$STATE"/log/slurmctld.log "$STATE"/log/*.out "$STATE"/log/slurmd-*.log; do
    [[ -s "$f" ]] || continue
    printf -- '----- tail %s -----\n' "$f" >&2
    tail -n 15 "$f" >&2
  done
  command -v sinfo >/dev/null && sinfo -N -l >&2 2>&1 || true
  printf '[slurm_cluster] ERROR: %s (cluster left as is for debugging; run "%s down" to clean up)\n' "$1" "$0" >&2
  exit 1
}

wait_idle() {
  local t0=$SECONDS states
  while :; do
    states=$(sinfo -h -N -p debug -o '%N %t' 2>/dev/null | sort -u || true)
    if [[ $(awk '$2=="idle"' <<<"$states" | wc -l) -eq $NODES ]]; then
      return 0
    fi
    ((SECONDS - t0 >= TIMEOUT)) && fail_logs "nodes not idle after ${TIMEOUT}s: $(tr '\n' ' ' <<<"$states")"
    sleep 0.2
  done
}

# ---------------------------------------------------------------- health
is_up() {
  [[ -f "$STATE/.$MARK" && -f "$STATE/config" ]] || return 1
  [[ "$(cat "$STATE/config")" == "$(config_sig)" ]] || return 1
  grep -q "$MARK" "$CONF" 2>/dev/null || return 1
  local f p c n=0
  for f in "$STATE"/pids/*; do
    [[ -f $f ]] || continue
    read -r p c <"$f"
    pid_alive "$p" "$c" || return 1
    [[ $c == slurmd ]] && n=$((n + 1))
  done
  ((n == NODES)) || return 1
  [[ -n "$(cat "$STATE/pids/slurmctld" 2>/dev/null)" ]] || return 1
  munge_works || return 1
  scontrol ping 2>/dev/null | grep -q 'is UP'
}

config_sig() { echo "nodes=$NODES cpus=$CPUS gpus=$GPUS$([[ $REAL_GPUS == 1 ]] && echo " (real)") cpu_nodes=$CPU_NODES mem=$MEM_MB debs=$DEBS extra=$EXTRA_CONF"; }

# ---------------------------------------------------------------- commands
do_down() {
  local quiet=${1:-}
  local f p c i sig
  # 1. slurmctld and all slurmd together (slurmctld first, so it queues no messages to
  #    dying nodes), then everything still inside the node namespaces (slurmstepd, job tasks),
  #    then munged (only if we started it).
  local -a l=()
  for f in "$STATE"/pids/slurmctld "$STATE"/pids/slurmd-*; do
    [[ -f $f ]] || continue
    read -r p c <"$f"
    l+=("$p" "$c")
  done
  ((${#l[@]} == 0)) || stop_pids 10 "${l[@]}"
  rm -f "$STATE"/pids/slurmd-* "$STATE/pids/slurmctld"
  # slurmstepd ignores TERM: give job tasks 1 s to exit on TERM, then KILL what is left.
  for sig in TERM KILL; do
    p=$(ns_pids | tr '\n' ' ')
    [[ -n "${p// /}" ]] || break
    # shellcheck disable=SC2086
    kill -"$sig" $p 2>/dev/null || true
    for ((i = 0; i < 20; i++)); do
      [[ -z "$(ns_pids)" ]] && break
      sleep 0.05
    done
  done
  if [[ -f "$STATE/pids/munged" ]]; then
    read -r p c <"$STATE/pids/munged"
    stop_pids 10 "$p" "$c"
    rm -f "$STATE/pids/munged"
  fi
  # 2. network, hosts block, config files.
  net_down
  hosts_remove
  for f in "$CONF" "$GRES_CONF" "$CGROUP_CONF"; do
    [[ -f $f ]] && grep -q "$MARK" "$f" && rm -f "$f"
  done
  remove_wrappers
  rm -f "$STATE/config"
  [[ -n $quiet ]] || log "down (logs kept in $STATE/log until the next 'up')"
}

do_up() {
  local t0=$SECONDS
  ensure_packages
  if is_up; then
    log "already up"
    do_status
    return 0
  fi
  do_down quiet
  # Fresh state directory (only if it is ours or does not exist yet).
  if [[ -e "$STATE" ]]; then
    [[ -f "$STATE/.$MARK" || -z "$(ls -A "$STATE")" ]] ||
      die "$STATE exists and was not created by this tool; refusing to wipe it"
    rm -rf "${STATE:?}"/*
  fi
  mkdir -p "$STATE"/{ctld,spool,log,run,pids,dev}
  touch "$STATE/.$MARK"
  install_wrappers
  chmod 755 "$STATE" "$STATE/log"
  write_configs
  start_munge
  net_up
  hosts_add
  start_slurmctld
  local i n
  for ((i = 1; i <= NODES; i++)); do start_slurmd "$i"; done
  for ((i = 1; i <= NODES; i++)); do
    n=$(node_name "$i")
    p=$(read_pidfile "$STATE/run/slurmd-$n.pid") || fail_logs "slurmd on $n did not start"
    record_pid "slurmd-$n" "$p" slurmd
  done
  wait_idle
  config_sig >"$STATE/config"
  log "up: $NODES nodes idle after $((SECONDS - t0))s"
  do_status
}

do_status() { # exit 0 if up, 3 if down or degraded
  local rc=0
  if [[ -f "$STATE/config" ]]; then
    echo "cluster: UP ($(cat "$STATE/config"))"
  else
    echo "cluster: DOWN (no $STATE/config)"
    rc=3
  fi
  if command -v sinfo >/dev/null && grep -qs "$MARK" "$CONF"; then
    sinfo -N -o '%N %T %c %m %G %P' 2>&1 || true
  fi
  echo "daemons:"
  local f p c st any=0
  for f in "$STATE"/pids/*; do
    [[ -f $f ]] || continue
    any=1
    read -r p c <"$f"
    if pid_alive "$p" "$c"; then st=running; else st=DEAD; rc=3; fi
    printf '  %-16s pid %-8s %s\n' "$(basename "$f")" "$p" "$st"
  done
  ((any)) || echo "  (none recorded)"
  echo "state: $STATE   logs: $STATE/log   config: $CONF"
  if [[ -f "$STATE/pids/slurmd-node1" ]]; then
    echo "enter a node: nsenter -t \$(cut -d' ' -f1 $STATE/pids/slurmd-node1) -n -u"
  fi
  return $rc
}

main() {
  local cmd=${1:-}
  case "$cmd" in
    up | down | status) ;;
    *) echo "usage: $0 up|down|status   (see docs/slurm-test-cluster.md)" >&2; exit 2 ;;
  esac
  need_root
  check_args
  if [[ -n $DEBS && $cmd != up ]]; then use_debs; fi
  exec 9>"$LOCK"
  flock -w 120 9 || die "another slurm_cluster.sh is running (lock $LOCK)"
  case "$cmd" in
    up) do_up ;;
    down) do_down ;;
    status) do_status ;;
  esac
}

main "$@"
