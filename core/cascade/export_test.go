package cascade

// Internals that the tests read. The tests are package cascade_test: the
// GPU and reference tests import core/attn, which imports this package.

const (
	IRep, IKVBegin, IKVEnd, IDynamic   = iRep, iKVBegin, iKVEnd, iDynamic
	IMBegin, IMCount, ITile, IPartBase = iMBegin, iMCount, iTile, iPartBase
	HTailTileQ, HHopperItems           = hTailTileQ, hHopperItems
	DecodeTailRows, ChunkAlign         = decodeTailRows, chunkAlign
)

func TileWeight(rows int64) int64 { return tileWeight(rows) }

// SetKeepAll makes the planner emit every shared run, paying or not.
func (p *Planner) SetKeepAll(v bool) { p.keepAll = v }
func (p *Planner) KeepAll() bool     { return p.keepAll }

// NodeChunk is the KV chunk of the shared runs of the last plan.
func (p *Planner) NodeChunk() int64 { return p.nodeChunk }

// TailChunks is sequence s's tail chunks in the last plan.
func (p *Planner) TailChunks(s int) int32 { return p.tcs[s] }

// FirstNode is the last plan's first shared run: its query tokens and KV
// chunks.
func (p *Planner) FirstNode() (tCount, chunks int32) { return p.nodes[0].tCount, p.nodes[0].chunks }

func (p *Planner) DecodeCost(l *Layout, total, saved int64) float64 {
	return p.decodeCost(l, total, saved)
}
func (p *Planner) CascadeCost(l *Layout, total, saved int64) float64 {
	return p.cascadeCost(l, total, saved)
}
