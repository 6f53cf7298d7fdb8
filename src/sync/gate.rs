//! `Gate`: the server's admission count. Up to `limit` requests hold a ticket at once;
//! past it, or once the gate is closed for a drain, a request is turned away at the door
//! instead of waiting with its body in memory. A ticket is given back when dropped (the
//! response's body is done or the client hung up), so a drain can tell when the last
//! request in flight has finished.

use super::{Arc, Mutex, MutexGuard};

#[derive(Clone)]
pub struct Gate {
    state: Arc<Mutex<GateState>>,
}

struct GateState {
    inside: usize,
    limit: usize,
    closed: bool,
}

/// Why `Gate::enter` turned a request away.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// `limit` requests are inside.
    Full,
    /// The gate is closed (the server is draining).
    Closed,
}

/// One admitted request; leaving is dropping it.
pub struct Ticket {
    state: Arc<Mutex<GateState>>,
}

impl Gate {
    pub fn new(limit: usize) -> Self {
        Gate {
            state: Arc::new(Mutex::new(GateState {
                inside: 0,
                limit,
                closed: false,
            })),
        }
    }

    fn lock(&self) -> MutexGuard<'_, GateState> {
        lock(&self.state)
    }

    pub fn enter(&self) -> Result<Ticket, Refusal> {
        let mut st = self.lock();
        if st.closed {
            return Err(Refusal::Closed);
        }
        if st.inside >= st.limit {
            return Err(Refusal::Full);
        }
        st.inside += 1;
        Ok(Ticket {
            state: self.state.clone(),
        })
    }

    /// No request is let in from now on; those inside keep their tickets.
    pub fn close(&self) {
        self.lock().closed = true;
    }

    pub fn is_closed(&self) -> bool {
        self.lock().closed
    }

    pub fn num_inside(&self) -> usize {
        self.lock().inside
    }
}

fn lock(state: &Mutex<GateState>) -> MutexGuard<'_, GateState> {
    state.lock().unwrap_or_else(|e| e.into_inner())
}

impl Drop for Ticket {
    fn drop(&mut self) {
        lock(&self.state).inside -= 1;
    }
}
