// Package kvtier is the KV tiers below the GPU pool (issue 23) and their
// one owner, Tier (issue 34): host memory (package host) and a
// Valkey/Redis server that instances share (package valkey), with the
// policy that moves blocks between them and the GPU pool (demotion,
// write-through, reloads, shared-tier fetches and stores). A Tier owns its
// host pool (and the pool's memory when it makes it: Config.Slots), the
// shared tier's client and its store goroutine. The manager
// (core/kvmanager) owns one Tier and calls it; the C ABI translates only.
//
// # The caller's obligations
//
// The caller of a Tier (the manager) must:
//
//  1. Call every method under its own lock (the one it passes in
//     GPU.Lock), but Fetch and Close, which it calls without it: they take
//     the lock themselves around the parts that change the tier, and make
//     their round trips to the shared tier without it.
//  2. Hand the tier every change of the GPU blocks it must know of:
//     Allocated with every allocation, EvictForAlloc (or Evicted after
//     its own eviction) when an allocation evicts cached blocks,
//     NoteFilled for each block the prefix cache inserts, QueueComputed at
//     MarkComputed before the prefix cache's Commit.
//  3. Admit a prompt's host hits as PinHost, then QueueReloads with as
//     many fresh GPU blocks, then (once the prefix cache has inserted
//     them) LockReloads.
//  4. Include Check in its invariants: the tier holds references and
//     locks on GPU blocks (copies in flight), which the manager's counts
//     must credit.
//  5. Close the tier when done with it (a shared tier's goroutine lives
//     until then; a pool the tier made is released then, after which the
//     tier must not be used).
//
// The engine's obligations (the copies' ordering) follow.
//
// # How the tier uses the pools
//
// Demote on eviction. When the GPU pool evicts a cached block with hash h,
// the tier calls host.Pool.Reserve(h); on success it queues the
// GPU-to-host copy into Pool.Bytes(slot) and keeps the GPU block out of the
// free list until the copy has completed, then calls Commit(slot) (Abort on
// a failed copy) and only then frees the GPU block. When Reserve fails
// (OutOfBlocks: every host slot pinned; InvalidArgument: h already there)
// the demotion is skipped and the GPU block is freed at once. A committed
// block may also be written to the shared tier (valkey.Tier.Put, off the
// step's critical path: the call is bounded, but it is a network round
// trip; the tier queues it for a goroutine of its own, the host slot
// pinned until the store has read it).
//
// Reload on a hit. Admission matches the prompt's chained hashes tier by
// tier: the GPU prefix cache first, then host.Pool.PinPrefix on the
// remaining hashes (which pins the matched slots), then, for what is left,
// valkey.Tier.Exists then GetInto straight into freshly reserved host slots
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
//
// # Layer groups
//
// With layer groups (full-attention and sliding-window; groups.go has the
// rule) a host slot holds one (node, group) block, keyed GroupKey, and
// every copy op names its group (DemoteOp.Group, ReloadOp.Group): with the
// layer-slot layout a block id belongs to one group, so copying every
// layer slot of it moves that group's layers. A host hit obeys the GPU's
// hit rule: never without the window blocks its hit point reads.
package kvtier
