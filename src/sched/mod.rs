//! The pure scheduling core: block accounting, state slots, prefix cache, cost model and
//! the step planner. No ractor, tokio or device imports; unit-tested in milliseconds.
