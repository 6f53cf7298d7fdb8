//! The engine supervisor: spawns and links the scheduler, the sampler and one rank worker
//! per rank, and decides restarts. ractor's default would stop the supervisor when any
//! child exits; here a dead rank worker or sampler is restarted and the scheduler told to
//! recompute every unfinished sequence, until `max_rank_restarts` is spent or a restart
//! itself fails — then the scheduler fails every request with the reason.

use ractor::thread_local::{ThreadLocalActor, ThreadLocalActorSpawner};
use ractor::{Actor, ActorCell, ActorProcessingErr, ActorRef, RpcReplyPort, SupervisionEvent};

use super::fault::FaultPlan;
use super::rank_worker::{RankArgs, RankMsg, RankWorker};
use super::sampled_tokens::SampledTokens;
use super::sampler::{SamplerActor, SamplerArgs, SamplerMsg};
use super::scheduler::{SchedulerActor, SchedulerArgs, SchedulerMsg};

pub struct SupervisorArgs {
    pub scheduler: SchedulerArgs,
    pub rank: RankArgsTemplate,
    pub max_rank_restarts: usize,
}

/// What it takes to (re)start rank 0's worker.
#[derive(Clone)]
pub struct RankArgsTemplate {
    pub model_path: std::path::PathBuf,
    pub num_kv_blocks: usize,
    pub block_size: usize,
    pub faults: FaultPlan,
    pub batch_invariant: bool,
    pub device: crate::engine::Device,
    pub dummy_weights: bool,
    pub enforce_eager: bool,
    pub decode_curve: Option<super::decode_curve::CurveJob>,
}

pub enum SupervisorMsg {
    Children(RpcReplyPort<Children>),
}

#[derive(Clone)]
pub struct Children {
    pub scheduler: ActorRef<SchedulerMsg>,
    pub sampler: ActorRef<SamplerMsg>,
    pub worker: Option<ActorRef<RankMsg>>,
}

pub struct SupervisorState {
    children: Children,
    rank: RankArgsTemplate,
    sampled: SampledTokens,
    spawner: ThreadLocalActorSpawner,
    num_rank_restarts: usize,
    max_rank_restarts: usize,
}

async fn spawn_worker(
    myself: &ActorCell,
    rank: &RankArgsTemplate,
    sampled: &SampledTokens,
    spawner: &ThreadLocalActorSpawner,
) -> Result<ActorRef<RankMsg>, String> {
    let args = RankArgs {
        rank: 0,
        model_path: rank.model_path.clone(),
        num_kv_blocks: rank.num_kv_blocks,
        block_size: rank.block_size,
        sampled: sampled.clone(),
        faults: rank.faults.clone(),
        device: rank.device,
        dummy_weights: rank.dummy_weights,
        enforce_eager: rank.enforce_eager,
        batch_invariant: rank.batch_invariant,
        decode_curve: rank.decode_curve.clone(),
    };
    RankWorker::spawn_linked(None, args, myself.clone(), spawner.clone())
        .await
        .map(|(r, _)| r)
        .map_err(|e| e.to_string())
}

pub struct EngineSupervisor;

impl EngineSupervisor {
    /// Takes one restart from the shared budget, or, when it is spent, tells the scheduler
    /// the engine is lost and returns false.
    fn spend_restart(st: &mut SupervisorState, who: &str, why: &str) -> bool {
        if st.num_rank_restarts >= st.max_rank_restarts {
            let reason = format!(
                "{who} failed {} times, last: {why}",
                st.num_rank_restarts + 1
            );
            let _ = st
                .children
                .scheduler
                .cast(SchedulerMsg::RankLost { reason });
            return false;
        }
        st.num_rank_restarts += 1;
        true
    }

    async fn restart_worker(
        myself: &ActorRef<SupervisorMsg>,
        st: &mut SupervisorState,
        why: String,
    ) {
        st.children.worker = None;
        if !Self::spend_restart(st, "rank 0", &why) {
            return;
        }
        tracing::warn!("rank 0 worker died ({why}); restarting");
        match spawn_worker(&myself.get_cell(), &st.rank, &st.sampled, &st.spawner).await {
            Ok(worker) => {
                st.children.worker = Some(worker.clone());
                let _ = st.children.scheduler.cast(SchedulerMsg::Attach {
                    worker: Some(worker),
                    sampler: None,
                });
            }
            Err(e) => {
                let reason = format!("rank 0 died ({why}) and could not be restarted: {e}");
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
            scheduler: st.children.scheduler.clone(),
            sampled: st.sampled.clone(),
            faults: st.rank.faults.clone(),
        };
        let (sampler, _) =
            SamplerActor::spawn_linked(None, SamplerActor, args, myself.get_cell()).await?;
        st.children.sampler = sampler.clone();
        st.children.scheduler.cast(SchedulerMsg::Attach {
            worker: None,
            sampler: Some(sampler),
        })?;
        Ok(())
    }
}

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
            scheduler: scheduler.clone(),
            sampled: sampled.clone(),
            faults: args.rank.faults.clone(),
        };
        let (sampler, _) =
            SamplerActor::spawn_linked(None, SamplerActor, sampler_args, myself.get_cell()).await?;
        // One OS thread per rank, kept across restarts of its worker.
        let spawner = ThreadLocalActorSpawner::new();
        let worker = spawn_worker(&myself.get_cell(), &args.rank, &sampled, &spawner).await?;
        scheduler.cast(SchedulerMsg::Attach {
            worker: Some(worker.clone()),
            sampler: Some(sampler.clone()),
        })?;
        Ok(SupervisorState {
            children: Children {
                scheduler,
                sampler,
                worker: Some(worker),
            },
            rank: args.rank,
            sampled,
            spawner,
            num_rank_restarts: 0,
            max_rank_restarts: args.max_rank_restarts,
        })
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
        _myself: ActorRef<SupervisorMsg>,
        st: &mut SupervisorState,
    ) -> Result<(), ActorProcessingErr> {
        // A worker blocked on tokens that will never come must wake up and exit.
        st.sampled.invalidate();
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
        if st
            .children
            .worker
            .as_ref()
            .is_some_and(|w| w.get_id() == id)
        {
            // The worker's tokens in flight are void: wake anything waiting on them.
            st.sampled.invalidate();
            Self::restart_worker(&myself, st, why).await;
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
