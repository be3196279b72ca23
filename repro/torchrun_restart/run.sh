#!/bin/bash
# Runs every variant (one torchrun at a time) and appends counts to $REPRO_OUT/results.txt (run.py).
# usage: ./run.sh [N]   (default N=10)
set -u
N=${1:-10}
cd "$(dirname "$0")"
R="${PYTHON:-python3} run.py"
$R baseline        $N
$R baseline_extra1 $N REPRO_EXTRA_GROUPS=1
# probe: print the stale gloo keys (and dead ports) a restarted rank finds in the store
$R probe           $N REPRO_PROBE=1
$R prefix          $N REPRO_WORKAROUND=prefix
$R prefix_extra1   $N REPRO_WORKAROUND=prefix REPRO_EXTRA_GROUPS=1
$R prefix_extra2   $N REPRO_WORKAROUND=prefix REPRO_EXTRA_GROUPS=2
$R destroy         $N REPRO_DESTROY=1
$R destroy_extra1  $N REPRO_DESTROY=1 REPRO_EXTRA_GROUPS=1
$R cleanup         $N REPRO_CLEANUP=1
$R cleanup_extra1  $N REPRO_CLEANUP=1 REPRO_EXTRA_GROUPS=1
$R no_share_store  $N TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
$R no_share_store_extra1 $N TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 REPRO_EXTRA_GROUPS=1
$R use_agent_store0 $N TORCHELASTIC_USE_AGENT_STORE=0
$R gloo_lazy_init  $N TORCH_GLOO_LAZY_INIT=1
$R c10d_endpoint   $N -- --rdzv-backend=c10d --rdzv-endpoint=localhost:29561 --rdzv-id=trr
$R static_rdzv     $N -- --rdzv-backend=static --master-addr=127.0.0.1 --master-port=29562 --nnodes=1 --node-rank=0
$R monitor_3s      $N -- --standalone --monitor-interval=3
