"""Write a SLURM batch script for a multi-node run of either trainer (docs/cluster.md explains every line).

  python -m jaxpar.tools.launch --nodes 2 --gpus-per-node 8 --time 04:00:00 --partition gpu \\
      --config configs/gpt2-124m.yaml --mesh dp=2,fsdp=8 [key=value ...] > job.sbatch
  python -m jaxpar.tools.launch --framework torchpar --backend fsdp --launcher torchrun ... > job.sbatch
  python -m jaxpar.tools.launch --elastic 1:4 --nodes 4 ... --mesh dp=-1,tp=8 > job.sbatch   # survives lost nodes
  python -m jaxpar.tools.launch --torchft --framework torchpar --backend ddp --mesh diloco=2,dp=8 ... > job.sbatch

Launch lines: jaxpar: `srun` with one task per GPU (jax.distributed reads SLURM_*) or `torchrun` once per node;
torchpar: `srun` with one task per GPU (torchpar reads SLURM_*), `torchrun` once per node (c10d rendezvous on the
first node), or DeepSpeed's launcher from the first node (a hostfile from the node list; needs ssh between nodes).
`--elastic MIN[:MAX]`: torchrun's elastic agent for either trainer -- a lost node ends its processes, the agent
restarts the rest on the nodes left (at least MIN) from the last checkpoint, and a node back grows the group again.
`--torchft`: torchpar's DiLoCo groups as separate launches (docs/diloco.md "torchft"): torchft's lighthouse on the
first node, and each of the mesh's diloco groups on its share of the nodes with its own torchrun rendezvous and run
directory, relaunched when it fails (it heals from a live group at its first meeting).
The config and overrides are validated now, so that a typo fails here and not after hours in the queue.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys

from jaxpar.checks import check_layout
from jaxpar.core.data.batch_shapes import for_each_shape
from jaxpar.core.config.schema import load_config
from jaxpar.core.errors import UserError, cli
from jaxpar.core.run.directory import with_run_dir
from jaxpar.core.config.mesh_spec import check_torch_mesh, parse_mesh, resolve_sizes
from jaxpar.core.optimizer.torchft_mode import check_torchft

LAUNCHERS = {"jaxpar": ("srun", "torchrun"), "torchpar": ("srun", "torchrun", "deepspeed")}
# torchrun's / DeepSpeed's rendezvous port on the first node, by the formula torchpar uses under srun
# (torchpar/dist.py): two jobs that share a first node do not collide
PORT = "$((29500 + SLURM_JOB_ID % 20000))"


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="python -m jaxpar.tools.launch", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--framework", choices=tuple(LAUNCHERS), default="jaxpar")
    p.add_argument("--launcher", help="srun (default), torchrun or deepspeed (torchpar only)")
    p.add_argument("--backend", help="torchpar backend: ddp, fsdp, deepspeed, pipeline")
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--gpus-per-node", type=int, required=True)
    p.add_argument("--time", required=True, help="wall-clock limit, e.g. 04:00:00")
    p.add_argument("--partition", required=True)
    p.add_argument("--account", help="#SBATCH --account, if your cluster wants one")
    p.add_argument("--cpus-per-gpu", type=int, default=8)
    p.add_argument("--job-name", help="default: <framework>-<run.dir's last part>")
    p.add_argument("--config", help="YAML config (configs/*.yaml)")
    p.add_argument("--mesh", help="mesh axes (overrides parallel.mesh); torchpar gets it as parallel.mesh=...")
    p.add_argument(
        "--elastic",
        metavar="MIN[:MAX]",
        help="nodes the run may shrink to and grow back to (MAX: --nodes); launches torchrun's agent",
    )
    p.add_argument(
        "--max-restarts", type=int, help="--elastic: restarts after failures (default 3); --torchft: each group's"
    )
    p.add_argument("--torchft", action="store_true", help="torchpar's DiLoCo groups as launches joined by torchft")
    p.add_argument("overrides", nargs="*", help="section.key=value overrides")
    return p.parse_intermixed_args(argv)


def check_launch(args) -> str:
    """Refuse what cannot run; return the launcher."""
    launcher = args.launcher or ("torchrun" if args.elastic or args.torchft else "srun")
    if args.elastic and launcher != "torchrun":
        raise UserError(f"--elastic runs under torchrun's agent, not --launcher {launcher}")
    if args.max_restarts is not None and not (args.elastic or args.torchft):
        raise UserError("--max-restarts is --elastic's (a fixed-size job restarts by SLURM's --requeue)")
    if args.torchft:
        return check_torchft_launch(args, launcher)
    if launcher not in LAUNCHERS[args.framework]:
        raise UserError(
            f"--launcher {launcher} is not one for {args.framework}; choose {', '.join(LAUNCHERS[args.framework])}"
        )
    if args.framework == "torchpar" and not args.backend:
        raise UserError("--framework torchpar needs --backend (ddp, fsdp, deepspeed or pipeline)")
    if args.framework == "jaxpar" and args.backend:
        raise UserError("--backend is torchpar's; jaxpar takes --mesh")
    if launcher == "deepspeed" and args.backend != "deepspeed":
        raise UserError("--launcher deepspeed runs --backend deepspeed")
    if args.nodes < 1 or args.gpus_per_node < 1:
        raise UserError("--nodes and --gpus-per-node must be at least 1")
    cfg = load_config(args.config, args.overrides)
    mesh = args.mesh or cfg.parallel.mesh
    low, high = elastic_nodes(args, mesh) if args.elastic else (args.nodes, args.nodes)
    for nodes in range(low, high + 1):  # every size the group may take
        try:
            if args.framework == "torchpar":  # the backend and the axes it runs, before the job waits in the queue
                check_torch_mesh(mesh, args.backend, nodes * args.gpus_per_node)
            else:  # the divisibility the layout needs (heads, batch per data way, sequence) at this size
                sizes = resolve_sizes(parse_mesh(mesh or "dp=-1"), nodes * args.gpus_per_node)
                for_each_shape(cfg, lambda at: check_layout(at, sizes))
        except UserError as e:
            raise UserError(f"--elastic {args.elastic}, on {nodes} node(s): {e}" if args.elastic else str(e)) from None
    return launcher


def check_torchft_launch(args, launcher: str) -> str:
    """--torchft: torchpar on ddp under torchrun, diloco=G in the mesh dividing the nodes, the groups' config valid."""
    if args.framework != "torchpar" or args.backend != "ddp" or launcher != "torchrun" or args.elastic:
        raise UserError("--torchft launches torchpar's --backend ddp under torchrun (not --elastic)")
    cfg = load_config(args.config, [*args.overrides, "parallel.torchft_lighthouse=head:1"])
    mesh = parse_mesh(args.mesh or cfg.parallel.mesh or "dp=-1")
    groups = mesh.get("diloco", 1)
    if groups < 2 or args.nodes % groups:
        raise UserError(
            f"--torchft needs diloco=G (G >= 2) in --mesh, G dividing --nodes ({args.nodes}): one launch a group"
        )
    mesh_text = ",".join(f"{a}={n}" for a, n in mesh.items())
    check_torch_mesh(mesh_text, "ddp", args.nodes * args.gpus_per_node)
    check_torchft(dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, mesh=mesh_text)), "ddp")
    return launcher


def elastic_nodes(args, mesh: str) -> tuple[int, int]:
    """--elastic MIN[:MAX] as (MIN, MAX); the mesh must have an axis that follows the devices (-1) where it is set."""
    low, _, high = args.elastic.partition(":")
    try:
        low, high = int(low), int(high or args.nodes)
    except ValueError:
        raise UserError(f"--elastic {args.elastic}: expected MIN or MIN:MAX nodes, e.g. 2:4") from None
    if not 1 <= low <= high <= args.nodes:
        raise UserError(f"--elastic {args.elastic}: needs 1 <= MIN <= MAX <= --nodes ({args.nodes})")
    if args.framework == "jaxpar" and -1 not in parse_mesh(mesh or "dp=-1").values():
        raise UserError(f"--elastic needs a mesh axis that follows the devices: -1 in --mesh (e.g. dp=-1), not {mesh}")
    return low, high


def trainer_args(args) -> str:
    """The trainer's own arguments: jaxpar.train takes --mesh.

    torchpar.train has no --mesh flag and reads the mesh as the override parallel.mesh=..., put last so that it wins
    over one in the overrides.
    """
    words = [] if args.framework == "jaxpar" else ["--backend", args.backend]
    words += ["--config", args.config] if args.config else []
    if args.framework == "jaxpar":
        words += (["--mesh", args.mesh] if args.mesh else []) + list(args.overrides)
    else:
        words += list(args.overrides) + ([f"parallel.mesh={args.mesh}"] if args.mesh else [])
    return " ".join(shlex.quote(w) for w in words)


def torchft_lines(args, run_dir: str) -> list[str]:
    """The lighthouse on the first node and one launch per group, each relaunched when it fails (--max-restarts)."""
    cfg = load_config(args.config, [*args.overrides, "parallel.torchft_lighthouse=head:1"])
    groups = parse_mesh(args.mesh or cfg.parallel.mesh)["diloco"]
    nodes, restarts = args.nodes // groups, 3 if args.max_restarts is None else args.max_restarts
    group_args = f"parallel.torchft_lighthouse=$HEAD:$((PORT + 1)) parallel.torchft_group=$1 run.dir={run_dir}/group$1"
    return [
        f"# torchft (docs/diloco.md): its lighthouse on the first node; {groups} DiLoCo groups of {nodes} node(s),",
        "# each relaunched when it fails: it starts afresh and heals from a live group at its first meeting",
        'srun --nodes=1 --ntasks=1 --nodelist="$HEAD" --overlap torchft_lighthouse --min_replicas 1 '
        '--bind "[::]:$((PORT + 1))" &',
        "LIGHTHOUSE=$!",
        "group() {  # group $1 on its nodes, with its own rendezvous",
        f'  local nodes=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n "$(($1 * {nodes} + 1)),'
        f'$((($1 + 1) * {nodes}))p" | paste -sd,)',
        f"  for attempt in $(seq 0 {restarts}); do",
        f'    srun --nodes={nodes} --ntasks-per-node=1 --nodelist="$nodes" --kill-on-bad-exit=1 torchrun '
        f"--nnodes={nodes} --nproc_per_node={args.gpus_per_node} --rdzv_backend=c10d --rdzv_id=$SLURM_JOB_ID-$1 "
        f'--rdzv_endpoint="${{nodes%%,*}}:$((PORT + 2 + $1))" -m torchpar.train {trainer_args(args)} {group_args} '
        "&& return 0",
        "  done",
        "  return 1",
        "}",
        "pids=()",
        f'for g in $(seq 0 {groups - 1}); do group "$g" & pids+=($!); done',
        'rc=0; for p in "${pids[@]}"; do wait "$p" || rc=1; done',
        'kill "$LIGHTHOUSE" 2>/dev/null || true',
        "exit $rc",
    ]


def launch_line(args, launcher: str) -> str:
    module = f"{args.framework}.train"
    if launcher == "srun":  # one task per GPU; each process finds its rank in SLURM_*
        return f"srun --kill-on-bad-exit=1 python -m {module} {trainer_args(args)}"
    if launcher == "torchrun" and args.elastic:  # a node lost is not the job lost: the agents re-form the group
        low, _, high = args.elastic.partition(":")
        return (
            "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1  # each group its own store: a node can join again\n"
            f"srun --ntasks-per-node=1 --no-kill torchrun --nnodes={low}:{high or args.nodes} "
            f"--nproc_per_node={args.gpus_per_node} --max-restarts={args.max_restarts or 3} --rdzv_backend=c10d "
            f"--rdzv_id=$SLURM_JOB_ID --rdzv_endpoint=$HEAD:$PORT -m {module} {trainer_args(args)}"
        )
    if launcher == "torchrun":  # one torchrun per node; they meet on the first node
        # jaxpar's coordinator takes MASTER_PORT, free with a store per group (else one above, another job's port)
        store = "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1\n" if args.framework == "jaxpar" else ""
        return (
            store + "srun --ntasks-per-node=1 --kill-on-bad-exit=1 torchrun --nnodes=$SLURM_JOB_NUM_NODES "
            f"--nproc_per_node={args.gpus_per_node} --rdzv_backend=c10d --rdzv_id=$SLURM_JOB_ID "
            f"--rdzv_endpoint=$HEAD:$PORT -m {module} {trainer_args(args)}"
        )
    return (
        'scontrol show hostnames "$SLURM_JOB_NODELIST" | sed "s/$/ slots='
        + str(args.gpus_per_node)
        + '/" > "hostfile.$SLURM_JOB_ID"\n'
        f'deepspeed --hostfile "hostfile.$SLURM_JOB_ID" --master_addr "$HEAD" --master_port "$PORT" '
        f"--module {module} {trainer_args(args)}"
    )


def script(args, launcher: str, argv: list[str]) -> str:
    cfg = with_run_dir(load_config(args.config, args.overrides), args.framework, args.config)
    name = args.job_name or f"{args.framework}-{cfg.run.dir.rstrip('/').rsplit('/', 1)[-1]}"
    tasks = 1 if launcher != "srun" else args.gpus_per_node
    cpus = args.cpus_per_gpu * args.gpus_per_node // tasks
    header = [
        f"--job-name={name}",
        f"--nodes={args.nodes}",
        f"--ntasks-per-node={tasks}",
        f"--gpus-per-node={args.gpus_per_node}",
        f"--cpus-per-task={cpus}",
        f"--time={args.time}",
        f"--partition={args.partition}",
        "--output=%x-%j.out",  # in the submit directory (exists already)
        "--signal=TERM@120",  # SIGTERM to every task 2 min before the limit: an agreed stop + checkpoint
    ] + ([] if args.torchft else ["--requeue"])  # a preempted job goes back to the queue and resumes from that
    # checkpoint (torchft's groups do not resume from one yet)
    header += ["--no-kill"] if args.elastic else []  # a failed node does not end the job: the agents carry on
    header += [f"--account={args.account}"] if args.account else []
    return "\n".join(
        [
            "#!/bin/bash",
            f"# written by: python -m jaxpar.tools.launch {' '.join(shlex.quote(a) for a in argv)}",
            *(f"#SBATCH {h}" for h in header),
            "set -euo pipefail",
            *(
                [
                    'HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)  # the first node',
                    f"PORT={PORT}  # the rendezvous port",
                ]
                if launcher != "srun"
                else []
            ),
            "export PYTHONUNBUFFERED=1",
            "# NCCL (docs/cluster.md): name the inter-node interface if NCCL picks a wrong one; INFO to debug a hang",
            "# export NCCL_SOCKET_IFNAME=ib0",
            "export NCCL_DEBUG=${NCCL_DEBUG:-WARN}",
            *(torchft_lines(args, cfg.run.dir) if args.torchft else [launch_line(args, launcher)]),
            "",
        ]
    )


@cli
def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    launcher = check_launch(args)
    print(script(args, launcher, argv), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
