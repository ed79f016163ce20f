// Package kvtier is the root of the KV tiers below the GPU pool (issue
// 23): host memory (package host) and a Valkey/Redis server that
// instances share (package valkey). This package holds no code; its
// subpackages are self-contained, and the manager (core/kvmanager: tier.go
// for the host tier, shared.go for the shared one) and the C ABI build on
// them.
//
// # How the manager uses them
//
// Demote on eviction. When the GPU pool evicts a cached block with hash h,
// the manager calls host.Pool.Reserve(h); on success it queues the
// GPU-to-host copy into Pool.Bytes(slot) and keeps the GPU block out of the
// free list until the copy has completed, then calls Commit(slot) (Abort on
// a failed copy) and only then frees the GPU block. When Reserve fails
// (OutOfBlocks: every host slot pinned; InvalidArgument: h already there)
// the demotion is skipped and the GPU block is freed at once. A committed
// block may also be written to the shared tier (valkey.Tier.Put, off the
// step's critical path: the call is bounded, but it is a network round
// trip; the manager queues it for a goroutine of its own, the host slot
// pinned until the store has read it).
//
// Reload on a hit. Admission matches the prompt's chained hashes tier by
// tier: the GPU prefix cache first, then host.Pool.PinPrefix on the
// remaining hashes (which pins the matched slots), then, for what is left,
// valkey.Tier.Prefix or GetInto straight into freshly reserved host slots
// (Commit each one found, Abort the rest: a shared-tier block always passes
// through the host tier). For the host hits the manager allocates GPU
// blocks, queues the host-to-GPU copies on the engine's stream ahead of the
// step's attention (all blocks and layers in one batch), and Unpins each
// slot once its copy has completed.
//
// Ordering rules, for the manager and for an engine that drives its own
// copies:
//
//  1. A GPU block being demoted is not reused before its copy completes,
//     and a host slot is Committed only after the copy into it completed:
//     Lookup never reports a block whose bytes are still arriving.
//  2. A host slot being read (a reload in flight) stays pinned until that
//     copy completes: Reserve never evicts or reuses a pinned slot, so the
//     bytes cannot change under the copy.
//  3. The reload's copies are ordered before the step's attention on the
//     same stream (or an event the stream waits on); the GPU blocks count
//     as cached only then.
//  4. The shared tier is best effort: every call returns within its
//     operation timeout and a miss is always a correct answer (the prefix
//     is recomputed), so no step depends on the server being up.
package kvtier
