package kvmanager

import (
	"github.com/kvplug/kvplug/core/cascade"
	"github.com/kvplug/kvplug/core/kverr"
)

// MaxCascadeTable bounds batch * max_blocks_per_seq of CascadeInput: the
// table it gathers into is library memory (1 GiB at this bound), so a wrong
// width is refused before it is allocated rather than exhausting the host.
const MaxCascadeTable = 1 << 28

// maxCascadeBatch is the largest batch a cascade plan holds (the capacity
// bound of cascade.NewLayout).
const maxCascadeBatch = 1 << 16

// CascadeScratch is the host memory CascadeInput gathers a batch's tables
// and lengths into, reused across steps so that planning allocates nothing
// once it has grown to the batch. Not safe for concurrent use; the zero
// value is ready.
type CascadeScratch struct {
	table []int32
	lens  []int32
}

// CascadeInput sets the batch fields of in (Tables, TableStride,
// MaxBlocksPerSeq, SeqLens, BlockSize) to the sequences ids as Describe
// would report them with max_blocks = maxBlocks, so that planning in gives
// the plan that describing the batch and planning its host arrays gives.
// The other fields of in (heads, dtype, slots, headroom, flags) are the
// caller's. in's slices point into sc until sc is used again.
//
// Each row holds the sequence's blocks in order; the entries past them are
// not written (Describe pads them with -1). The planner reads only the whole
// blocks within a sequence's length, as the C header says any reader of a
// described table must, so the padding never reaches a plan, and skipping it
// keeps the gather proportional to the batch's blocks rather than to its
// table width (an engine sizes max_blocks for its longest context).
//
// The gather runs under the manager's lock, so the tables and lengths are
// one consistent snapshot; planning runs after it, without the lock.
// Repeated ids are allowed (as in Describe). An empty ids gives an empty
// batch without taking the lock.
// Errors: InvalidArgument (maxBlocks < 1, len(ids) * maxBlocks above
// MaxCascadeTable, len(ids) above 2^16),
// UnknownSequence, BufferTooSmall (a sequence has more than maxBlocks
// blocks). On error in and sc are unchanged.
func (m *Manager) CascadeInput(ids []int64, maxBlocks int, in *cascade.Input, sc *CascadeScratch) error {
	n := len(ids)
	if maxBlocks < 1 || maxBlocks > 1<<30 {
		return kverr.Errorf(kverr.InvalidArgument, "cascade_input: max_blocks_per_seq must be in [1, 2^30]: got %d", maxBlocks)
	}
	if n > maxCascadeBatch {
		return kverr.Errorf(kverr.InvalidArgument, "cascade_input: batch must be in [0, %d]: got %d", maxCascadeBatch, n)
	}
	if int64(n)*int64(maxBlocks) > MaxCascadeTable {
		return kverr.Errorf(kverr.InvalidArgument, "cascade_input: batch %d * max_blocks_per_seq %d exceeds %d table entries", n, maxBlocks, MaxCascadeTable)
	}
	if n == 0 {
		in.Tables, in.SeqLens = nil, []int32{}
		in.TableStride, in.MaxBlocksPerSeq, in.BlockSize = maxBlocks, maxBlocks, m.bs
		return nil
	}
	m.mu.Lock()
	// Read-only, but released through unlock like the calls that change
	// the manager, so -race builds check the invariants after it too.
	defer m.unlock()
	batch, err := m.resolve("cascade_input", ids, true)
	if err != nil {
		return err
	}
	for i, s := range batch {
		if len(s.blocks) > maxBlocks {
			return kverr.Errorf(kverr.BufferTooSmall, "cascade_input: sequence %d has %d blocks, max_blocks_per_seq is %d", ids[i], len(s.blocks), maxBlocks)
		}
	}
	// Checked: from here on nothing fails, so sc changes only on success.
	need := (n-1)*maxBlocks + maxBlocks
	if cap(sc.table) < need {
		sc.table = make([]int32, need)
	}
	if cap(sc.lens) < n {
		sc.lens = make([]int32, n)
	}
	table, lens := sc.table[:need], sc.lens[:n]
	for i, s := range batch {
		copy(table[i*maxBlocks:], s.blocks)
		lens[i] = int32(s.length)
	}
	in.Tables, in.SeqLens = table, lens
	in.TableStride, in.MaxBlocksPerSeq, in.BlockSize = maxBlocks, maxBlocks, m.bs
	return nil
}
