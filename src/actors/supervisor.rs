//! The engine supervisor: spawns and links the scheduler, the sampler and one rank worker
//! per rank of the tensor-parallel group, and decides restarts. ractor's default would
//! stop the supervisor when any child exits; here a dead sampler is restarted, and a dead
//! rank takes its group down: the supervisor rebuilds it on the devices that still start,
//! at the largest group size the model allows there, and the scheduler recomputes every
//! unfinished sequence — until `max_rank_restarts` are spent within the restart window
//! (a rate, not a lifetime count) or no valid group size is
//! left; then the scheduler fails every request with the reason.

use ractor::thread_local::{ThreadLocalActor, ThreadLocalActorSpawner};
use ractor::{Actor, ActorCell, ActorProcessingErr, ActorRef, RpcReplyPort, SupervisionEvent};

use super::rank_worker::{RankMsg, RankWorker};
use super::sampler::{SamplerActor, SamplerArgs, SamplerMsg};
use super::scheduler::{SchedulerActor, SchedulerArgs, SchedulerMsg};
use crate::kernels::Device;
use crate::kernels::collective::{ChannelCollective, GroupAbort, GroupError, GroupJoin};
use crate::model::deepseek_v4::expert_parallel::largest_valid_ep;
use crate::model::tensor_parallel::{TpShard, largest_valid_tp};
use crate::runner::RankReport;
use crate::runner::sampled_tokens::SampledTokens;
use crate::runner::{RankArgs, RankSettings};

/// How long the supervisor waits for a rank that has started to answer a call; a rank
/// that does not is treated as having no answer, never waited on forever.
const RANK_CALL_TIMEOUT_MS: u64 = 30_000;

/// How long the supervisor's stop waits for its children to release their devices.
const CHILDREN_STOP_S: u64 = 30;

pub struct SupervisorArgs {
    pub scheduler: SchedulerArgs,
    pub rank: RankSettings,
    pub max_rank_restarts: usize,
    pub rank_restart_window: std::time::Duration,
}

pub enum SupervisorMsg {
    Children(RpcReplyPort<Children>),
}

#[derive(Clone)]
pub struct Children {
    pub scheduler: ActorRef<SchedulerMsg>,
    pub sampler: ActorRef<SamplerMsg>,
    /// The group's rank workers in rank order; empty while it is being rebuilt.
    pub workers: Vec<ActorRef<RankMsg>>,
}

pub struct SupervisorState {
    children: Children,
    rank: RankSettings,
    sampled: SampledTokens,
    /// One OS thread per device slot, kept across rebuilds.
    spawners: Vec<ThreadLocalActorSpawner>,
    /// Device slots where a rank failed to start: left out of later groups.
    lost: Vec<bool>,
    /// Cancels the current group's collectives when one of its ranks dies.
    abort: GroupAbort,
    /// When each restart inside the window happened, oldest first.
    restarts: std::collections::VecDeque<std::time::Instant>,
    max_rank_restarts: usize,
    rank_restart_window: std::time::Duration,
}

/// Starts one rank worker per device of the largest group the healthy devices allow, and
/// once all have started, has them join the group. A device whose rank fails to start is
/// marked lost and the group is retried without it.
async fn spawn_group(
    myself: &ActorCell,
    st: &mut SupervisorState,
) -> Result<Vec<ActorRef<RankMsg>>, String> {
    let mut last_failure = String::new();
    loop {
        let healthy: Vec<usize> = (0..st.rank.devices.len())
            .filter(|&d| !st.lost[d])
            .collect();
        let largest = match st.rank.num_routed_experts {
            Some(experts) => largest_valid_ep(experts, healthy.len()),
            None => largest_valid_tp(&st.rank.model_config, healthy.len()),
        };
        let Some(size) = largest else {
            return Err(format!(
                "no tensor-parallel group fits the {} device(s) still starting{}",
                healthy.len(),
                if last_failure.is_empty() {
                    String::new()
                } else {
                    format!(" (last start failure: {last_failure})")
                }
            ));
        };
        let mut workers = Vec::with_capacity(size);
        for (rank, &slot) in healthy[..size].iter().enumerate() {
            let t = &st.rank;
            let args = RankArgs {
                shard: TpShard { rank, size },
                device_slot: slot,
                sampled: st.sampled.clone(),
                settings: t.clone(),
            };
            let spawner = st.spawners[slot].clone();
            match RankWorker::spawn_linked(None, args, myself.clone(), spawner).await {
                Ok((worker, _)) => workers.push(worker),
                Err(e) => {
                    last_failure = format!("device slot {slot}: {e}");
                    tracing::warn!("rank {rank} of {size} did not start ({last_failure})");
                    st.lost[slot] = true;
                    break;
                }
            }
        }
        if workers.len() < size {
            for w in workers {
                w.stop(Some("its group is being rebuilt".into()));
            }
            continue;
        }
        st.abort = GroupAbort::default();
        if size > 1 {
            let joins = group_joins(st.rank.devices[healthy[0]], size, &st.abort)
                .map_err(|e| e.to_string())?;
            for (w, join) in workers.iter().zip(joins) {
                w.cast(RankMsg::JoinGroup(join))
                    .map_err(|e| format!("a rank died before joining its group: {e}"))?;
            }
        }
        return Ok(workers);
    }
}

/// What the group's ranks report as they start, in rank order (a rank that does not
/// answer in time reports nothing).
async fn rank_reports(workers: &[ActorRef<RankMsg>]) -> Vec<RankReport> {
    let mut reports = Vec::with_capacity(workers.len());
    for w in workers {
        reports.push(ractor::call_t!(w, RankMsg::Report, RANK_CALL_TIMEOUT_MS).unwrap_or_default());
    }
    reports
}

/// What each rank of a group of `size` on `device`'s kind joins.
fn group_joins(
    device: Device,
    size: usize,
    abort: &GroupAbort,
) -> Result<Vec<GroupJoin>, GroupError> {
    match device {
        Device::Cpu => Ok(ChannelCollective::group(size)
            .into_iter()
            .map(GroupJoin::Channels)
            .collect()),
        Device::Cuda(_) => crate::kernels::cuda::NcclJoin::group(size, abort)
            .map(|joins| joins.into_iter().map(GroupJoin::Nccl).collect()),
    }
}

pub struct EngineSupervisor;

impl EngineSupervisor {
    /// Takes one restart from the shared budget, or, when it is spent, tells the scheduler
    /// the engine is lost and returns false.
    fn spend_restart(st: &mut SupervisorState, who: &str, why: &str) -> bool {
        let now = std::time::Instant::now();
        while st
            .restarts
            .front()
            .is_some_and(|t| now.duration_since(*t) > st.rank_restart_window)
        {
            st.restarts.pop_front();
        }
        if st.restarts.len() >= st.max_rank_restarts {
            let reason = format!(
                "{who} failed {} times within {} s, last: {why}",
                st.restarts.len() + 1,
                st.rank_restart_window.as_secs_f64()
            );
            let _ = st
                .children
                .scheduler
                .cast(SchedulerMsg::RankLost { reason });
            return false;
        }
        st.restarts.push_back(now);
        true
    }

    /// A rank died: the whole group stops (its collectives are cancelled) and is rebuilt.
    async fn rebuild_group(
        myself: &ActorRef<SupervisorMsg>,
        st: &mut SupervisorState,
        rank: usize,
        why: String,
    ) {
        st.abort.abort();
        for w in std::mem::take(&mut st.children.workers) {
            w.stop(Some("a rank of its group died".into()));
        }
        if !Self::spend_restart(st, &format!("rank {rank}"), &why) {
            return;
        }
        tracing::warn!("rank {rank} worker died ({why}); rebuilding its group");
        match spawn_group(&myself.get_cell(), st).await {
            Ok(workers) => {
                st.children.workers = workers.clone();
                let reports = rank_reports(&workers).await;
                let _ = st.children.scheduler.cast(SchedulerMsg::Attach {
                    workers: Some(workers),
                    sampler: None,
                    reports,
                });
            }
            Err(e) => {
                let reason =
                    format!("rank {rank} died ({why}) and the group could not be rebuilt: {e}");
                let _ = st
                    .children
                    .scheduler
                    .cast(SchedulerMsg::RankLost { reason });
            }
        }
    }

    async fn restart_sampler(
        myself: &ActorRef<SupervisorMsg>,
        st: &mut SupervisorState,
    ) -> Result<(), ActorProcessingErr> {
        let args = SamplerArgs {
            scheduler: st.children.scheduler.get_derived(),
            sampled: st.sampled.clone(),
            faults: st.rank.faults.clone(),
        };
        let (sampler, _) =
            SamplerActor::spawn_linked(None, SamplerActor, args, myself.get_cell()).await?;
        st.children.sampler = sampler.clone();
        st.children.scheduler.cast(SchedulerMsg::Attach {
            workers: None,
            sampler: Some(sampler),
            reports: Vec::new(),
        })?;
        Ok(())
    }
}

// With ractor's `cluster` feature on (the router's nodes), every message type names itself
// one; these never leave the process.
impl ractor::Message for SupervisorMsg {}

impl Actor for EngineSupervisor {
    type Msg = SupervisorMsg;
    type State = SupervisorState;
    type Arguments = SupervisorArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<SupervisorMsg>,
        args: SupervisorArgs,
    ) -> Result<SupervisorState, ActorProcessingErr> {
        let sampled = args.scheduler.sampled.clone();
        let (scheduler, _) =
            SchedulerActor::spawn_linked(None, SchedulerActor, args.scheduler, myself.get_cell())
                .await?;
        let sampler_args = SamplerArgs {
            scheduler: scheduler.get_derived(),
            sampled: sampled.clone(),
            faults: args.rank.faults.clone(),
        };
        let (sampler, _) =
            SamplerActor::spawn_linked(None, SamplerActor, sampler_args, myself.get_cell()).await?;
        let num_devices = args.rank.devices.len();
        let mut st = SupervisorState {
            children: Children {
                scheduler: scheduler.clone(),
                sampler: sampler.clone(),
                workers: Vec::new(),
            },
            rank: args.rank,
            sampled,
            spawners: (0..num_devices)
                .map(|_| ThreadLocalActorSpawner::new())
                .collect(),
            lost: vec![false; num_devices],
            abort: GroupAbort::default(),
            restarts: std::collections::VecDeque::new(),
            max_rank_restarts: args.max_rank_restarts,
            rank_restart_window: args.rank_restart_window,
        };
        let workers = spawn_group(&myself.get_cell(), &mut st).await?;
        st.children.workers = workers.clone();
        let reports = rank_reports(&workers).await;
        scheduler.cast(SchedulerMsg::Attach {
            workers: Some(workers),
            sampler: Some(sampler),
            reports,
        })?;
        Ok(st)
    }

    async fn handle(
        &self,
        _myself: ActorRef<SupervisorMsg>,
        msg: SupervisorMsg,
        st: &mut SupervisorState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            SupervisorMsg::Children(reply) => {
                let _ = reply.send(st.children.clone());
            }
        }
        Ok(())
    }

    async fn post_stop(
        &self,
        myself: ActorRef<SupervisorMsg>,
        st: &mut SupervisorState,
    ) -> Result<(), ActorProcessingErr> {
        // A worker blocked on tokens that will never come, or in a collective with a
        // rank that already stopped, must wake up and exit.
        st.sampled.invalidate();
        st.abort.abort();
        // Stopped, not killed (a supervisor's end kills its children, skipping their
        // post_stop): the ranks release their devices, and the engine's shutdown returns
        // after that, when the process may exit.
        myself
            .stop_children_and_wait(
                Some("the engine is shutting down".into()),
                Some(std::time::Duration::from_secs(CHILDREN_STOP_S)),
            )
            .await;
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        myself: ActorRef<SupervisorMsg>,
        event: SupervisionEvent,
        st: &mut SupervisorState,
    ) -> Result<(), ActorProcessingErr> {
        let (who, why) = match event {
            SupervisionEvent::ActorFailed(who, err) => (who, err.to_string()),
            SupervisionEvent::ActorTerminated(who, _, reason) => {
                (who, reason.unwrap_or_else(|| "stopped".into()))
            }
            _ => return Ok(()),
        };
        let id = who.get_id();
        if let Some(rank) = st.children.workers.iter().position(|w| w.get_id() == id) {
            // The group's tokens in flight are void: wake anything waiting on them.
            st.sampled.invalidate();
            Self::rebuild_group(&myself, st, rank, why).await;
        } else if st.children.sampler.get_id() == id {
            st.sampled.invalidate();
            // Sampler restarts spend the same budget: a fault that recurs on every
            // recompute must end in an error, not a livelock.
            if !Self::spend_restart(st, "the sampler", &why) {
                return Ok(());
            }
            Self::restart_sampler(&myself, st).await?;
        } else if st.children.scheduler.get_id() == id {
            // The scheduler holds every request's state: without it the engine is gone.
            return Err(format!("scheduler died: {why}").into());
        }
        Ok(())
    }
}
