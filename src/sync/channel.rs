//! Unbounded multi-producer channels: crossbeam's normally; under loom a queue behind
//! loom's `Mutex` and `Condvar` with the same surface (loom cannot see inside crossbeam),
//! so the loom suites run the code that hands work over them (the CPU collective, the
//! store's disk writer).

#[cfg(not(feature = "loom"))]
pub use crossbeam_channel::{Receiver, RecvError, SendError, Sender, unbounded};

#[cfg(feature = "loom")]
pub use modelled::{Receiver, RecvError, SendError, Sender, unbounded};

#[cfg(feature = "loom")]
mod modelled {
    use std::collections::VecDeque;

    use crate::sync::{Arc, Condvar, Mutex};

    #[derive(Debug, PartialEq, Eq)]
    pub struct SendError<T>(pub T);

    #[derive(Debug, PartialEq, Eq)]
    pub struct RecvError;

    struct State<T> {
        queue: VecDeque<T>,
        senders: usize,
        receiver_alive: bool,
    }

    struct Chan<T> {
        state: Mutex<State<T>>,
        ready: Condvar,
    }

    pub struct Sender<T>(Arc<Chan<T>>);
    pub struct Receiver<T>(Arc<Chan<T>>);

    pub fn unbounded<T>() -> (Sender<T>, Receiver<T>) {
        let chan = Arc::new(Chan {
            state: Mutex::new(State {
                queue: VecDeque::new(),
                senders: 1,
                receiver_alive: true,
            }),
            ready: Condvar::new(),
        });
        (Sender(chan.clone()), Receiver(chan))
    }

    impl<T> Sender<T> {
        pub fn send(&self, item: T) -> Result<(), SendError<T>> {
            let mut s = self.0.state.lock().unwrap();
            if !s.receiver_alive {
                return Err(SendError(item));
            }
            s.queue.push_back(item);
            self.0.ready.notify_one();
            Ok(())
        }
    }

    impl<T> Clone for Sender<T> {
        fn clone(&self) -> Self {
            self.0.state.lock().unwrap().senders += 1;
            Sender(self.0.clone())
        }
    }

    impl<T> Drop for Sender<T> {
        fn drop(&mut self) {
            let mut s = self.0.state.lock().unwrap();
            s.senders -= 1;
            if s.senders == 0 {
                self.0.ready.notify_all();
            }
        }
    }

    impl<T> Receiver<T> {
        /// The next item; `Err` once every sender is gone and the queue is empty.
        pub fn recv(&self) -> Result<T, RecvError> {
            let mut s = self.0.state.lock().unwrap();
            loop {
                if let Some(item) = s.queue.pop_front() {
                    return Ok(item);
                }
                if s.senders == 0 {
                    return Err(RecvError);
                }
                s = self.0.ready.wait(s).unwrap();
            }
        }
    }

    impl<T> Drop for Receiver<T> {
        fn drop(&mut self) {
            self.0.state.lock().unwrap().receiver_alive = false;
        }
    }

    impl<T> IntoIterator for Receiver<T> {
        type Item = T;
        type IntoIter = Iter<T>;
        fn into_iter(self) -> Iter<T> {
            Iter(self)
        }
    }

    pub struct Iter<T>(Receiver<T>);

    impl<T> Iterator for Iter<T> {
        type Item = T;
        fn next(&mut self) -> Option<T> {
            self.0.recv().ok()
        }
    }
}
