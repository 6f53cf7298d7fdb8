//! A recorded decode step: the captured graph, its edges between troupe's own kernels made
//! programmatic, and the executable instance.
//!
//! A stream capture records each launch as waiting for the previous one to finish, so a
//! replayed step still pays a launch latency and a ramp at each of its ~10 kernels a layer.
//! A programmatic edge lets the next kernel's blocks be scheduled once every block of the
//! previous one has started (`griddepcontrol.launch_dependents`); the kernel then waits
//! for its predecessor's completion and writes in `pdl_enter` (llama.cu) before it reads
//! anything. Only edges between two kernels of troupe's module change: cuBLAS's kernels
//! do not wait that way, and copies and event records keep their full dependencies.

use std::ptr::null_mut;

use cudarc::driver::sys::{
    self, CUDA_KERNEL_NODE_PARAMS, CUgraph, CUgraphDependencyType, CUgraphEdgeData, CUgraphExec,
    CUgraphNode, CUgraphNodeType, CUmodule,
};
use cudarc::driver::{CudaFunction, CudaStream, DriverError};

/// troupe's kernel module, as a plain address (so the graphs that hold it stay `Send`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OwnModule(usize);

impl OwnModule {
    /// The module `function` was loaded from.
    pub fn of(function: &CudaFunction) -> Result<Self, DriverError> {
        let mut module: CUmodule = null_mut();
        // SAFETY: writes one handle; the function is alive.
        unsafe { sys::cuFuncGetModule(&mut module, function.cu_function()) }.result()?;
        Ok(OwnModule(module as usize))
    }

    fn holds(self, node: CUgraphNode) -> bool {
        let mut kind = CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
        // SAFETY: the node belongs to a live graph; each call writes its out-parameter.
        unsafe {
            if sys::cuGraphNodeGetType(node, &mut kind).result().is_err()
                || kind != CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL
            {
                return false;
            }
            let mut params: CUDA_KERNEL_NODE_PARAMS = std::mem::zeroed();
            if sys::cuGraphKernelNodeGetParams_v2(node, &mut params)
                .result()
                .is_err()
                || params.func.is_null()
            {
                return false;
            }
            let mut module: CUmodule = null_mut();
            sys::cuFuncGetModule(&mut module, params.func)
                .result()
                .is_ok()
                && module as usize == self.0
        }
    }
}

pub struct Recorded {
    graph: CUgraph,
    exec: CUgraphExec,
    /// How many edges were made programmatic.
    pub num_programmatic_edges: usize,
}

// SAFETY: plain driver handles, valid on any thread once the context is current; CUDA asks
// only that calls on one graph be serialized, which the backend's mutex does.
unsafe impl Send for Recorded {}

impl Recorded {
    /// Ends the stream's capture and instantiates what it recorded, with programmatic edges
    /// between `own`'s kernels when given.
    pub fn end_capture(stream: &CudaStream, own: Option<OwnModule>) -> Result<Self, DriverError> {
        stream.context().bind_to_thread()?;
        let mut graph: CUgraph = null_mut();
        // SAFETY: the stream is capturing (Graphs' phase says so); writes one handle.
        unsafe { sys::cuStreamEndCapture(stream.cu_stream(), &mut graph) }.result()?;
        let mut recorded = Recorded {
            graph,
            exec: null_mut(),
            num_programmatic_edges: 0,
        };
        if let Some(own) = own {
            // SAFETY: the graph was just captured and is not instantiated yet.
            recorded.num_programmatic_edges = unsafe { make_programmatic(graph, own) }?;
        }
        // SAFETY: writes one handle; on error `recorded`'s drop frees the graph.
        unsafe { sys::cuGraphInstantiateWithFlags(&mut recorded.exec, graph, 0) }.result()?;
        Ok(recorded)
    }

    /// Ends a capture that will not be used (a panic left it open), dropping what it
    /// recorded.
    pub fn abandon_capture(stream: &CudaStream) {
        let mut graph: CUgraph = null_mut();
        // SAFETY: writes one handle, destroyed at once; errors have no one to go to.
        unsafe {
            let _ = sys::cuStreamEndCapture(stream.cu_stream(), &mut graph);
            if !graph.is_null() {
                let _ = sys::cuGraphDestroy(graph);
            }
        }
    }

    /// The instance, for a launch from another thread (`graph_launcher.rs`).
    pub fn exec(&self) -> CUgraphExec {
        self.exec
    }

    pub fn launch(&self, stream: &CudaStream) -> Result<(), DriverError> {
        // SAFETY: the instance lives as long as `self`; the stream belongs to its context.
        unsafe { sys::cuGraphLaunch(self.exec, stream.cu_stream()) }.result()
    }
}

impl Drop for Recorded {
    fn drop(&mut self) {
        // SAFETY: handles created by end_capture, destroyed once; errors have no one to go to.
        unsafe {
            if !self.exec.is_null() {
                let _ = sys::cuGraphExecDestroy(self.exec);
            }
            if !self.graph.is_null() {
                let _ = sys::cuGraphDestroy(self.graph);
            }
        }
    }
}

/// Makes every full dependency between two of `own`'s kernels programmatic; returns how
/// many. Safety: `graph` is a live graph, not being launched or instantiated concurrently.
unsafe fn make_programmatic(graph: CUgraph, own: OwnModule) -> Result<usize, DriverError> {
    let mut num_edges = 0usize;
    // SAFETY (this block): null arrays ask for the count; the second call fills arrays of
    // that count; the edges passed back are the graph's own.
    unsafe {
        sys::cuGraphGetEdges_v2(graph, null_mut(), null_mut(), null_mut(), &mut num_edges)
            .result()?;
        let mut from: Vec<CUgraphNode> = vec![null_mut(); num_edges];
        let mut to: Vec<CUgraphNode> = vec![null_mut(); num_edges];
        let mut data: Vec<CUgraphEdgeData> = vec![std::mem::zeroed(); num_edges];
        sys::cuGraphGetEdges_v2(
            graph,
            from.as_mut_ptr(),
            to.as_mut_ptr(),
            data.as_mut_ptr(),
            &mut num_edges,
        )
        .result()?;
        let default = CUgraphDependencyType::CU_GRAPH_DEPENDENCY_TYPE_DEFAULT as u8;
        let mut changed = 0;
        for i in 0..num_edges {
            if data[i].type_ != default || !own.holds(from[i]) || !own.holds(to[i]) {
                continue;
            }
            sys::cuGraphRemoveDependencies_v2(graph, &from[i], &to[i], &data[i], 1).result()?;
            let mut edge = data[i];
            edge.type_ = CUgraphDependencyType::CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC as u8;
            edge.from_port = sys::CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC as u8;
            sys::cuGraphAddDependencies_v2(graph, &from[i], &to[i], &edge, 1).result()?;
            changed += 1;
        }
        Ok(changed)
    }
}
