// Package kvevents carries a prefix cache's KV events out of the process in
// vLLM's wire format (vllm/distributed/kv_events.py), so that routers and
// indexers written for vLLM (llm-d's kv-cache indexer, Dynamo's router,
// cmd/kvindex here) read kvplug engines unchanged:
//
//   - a PUB socket sends each batch as a three-frame message: the topic, the
//     batch's sequence number (8 bytes, big-endian, from 0) and the payload;
//   - the payload is a msgpack EventBatch: an array [ts, events] with a
//     third element, the data-parallel rank, when one is set;
//   - each event is a msgpack map tagged by its "type" (BlockStored,
//     BlockRemoved, AllBlocksCleared), the named-field encoding vLLM uses
//     since it dropped positional events; FormatArray selects the older
//     positional form ([tag, field, ...]) for consumers that need it;
//   - a manager with layer groups (a hybrid model) publishes every group's
//     blocks, each event with vLLM's group_idx (a BlockStored also with its
//     group's kv_cache_spec_kind and kv_cache_spec_sliding_window), after
//     the fields of vLLM's BlockStored and BlockRemoved, in their order
//     (Encoding.Groups); one without groups sends none of these fields;
//   - a snapshot (AllBlocksCleared and every cached block) cut into more
//     than one batch says so: its AllBlocksCleared, in the map form, has
//     kvplug's field kvplug_snapshot_rest, the number of batches after its
//     own that complete the set (SnapshotRestField), which vLLM's decoders
//     skip;
//   - a ROUTER socket replays the batches it still holds: a request is the
//     first wanted sequence number (8 bytes, big-endian), each reply is
//     [topic, seq, payload] and the last one [empty, -1, empty].
//
// The package also decodes that format (Decode), for cmd/kvindex and tests,
// and holds a subscriber that recovers missed batches by replay.
package kvevents

import (
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"strings"

	"github.com/kvplug/kvplug/core/prefix"
	"github.com/tinylib/msgp/msgp"
)

// msgpack: github.com/tinylib/msgp's runtime (no code generation). Its
// append-style writers encode a batch into one reused buffer with no
// reflection and no allocation per event, and its zero-copy readers decode
// an untrusted payload with every length checked against the bytes left,
// which suits both the engine's hot path and the indexer's decoder.

// Format is the msgpack layout of events.
type Format int32

const (
	// FormatMap: events are maps tagged by "type" (vLLM's current layout).
	FormatMap Format = 0
	// FormatArray: events are positional arrays [tag, fields...] (vLLM's
	// layout before it switched to maps).
	FormatArray Format = 1
)

// HashFormat is how block hashes go on the wire; vLLM's ExternalBlockHash
// is bytes or int.
type HashFormat int32

const (
	// HashBytes: the 16 bytes of the hash (HASH.md's canonical form).
	HashBytes HashFormat = 0
	// HashInt64: the hash's last 8 bytes as a big-endian unsigned integer,
	// as vLLM converts hashes for consumers that keep 64-bit keys.
	HashInt64 HashFormat = 1
	// HashDigest: a decoded hash of another length than 16 bytes (vLLM's
	// SHA-256 block hashes, 32 bytes), keyed by its XXH3-128. Such a hash
	// is an engine's own, never kvplug's: a consumer can only use it as a
	// name for the block (core/kvindex translates it from token_ids).
	// Decode only; an Encoder never writes it.
	HashDigest HashFormat = 2
)

// maxForeignHash bounds a decoded hash that is not 16 bytes long.
const maxForeignHash = 64

// EndSeq ends a replay: the sequence frame of the last reply.
const EndSeq = -1

// SnapshotSeq is kvplug's extension of the replay request: asking for
// "sequence" -2 (0xFFFF_FFFF_FFFF_FFFE) makes the publisher emit
// AllBlocksCleared and a BlockStored for every cached block on its PUB
// socket, for a subscriber whose gap is older than the replay buffer. A
// vLLM publisher reads it as a sequence past its newest and answers with
// the end marker only.
const SnapshotSeq = -2

// Encoding is what Encoder needs besides the events.
type Encoding struct {
	Format    Format
	Hashes    HashFormat
	Medium    string // "medium" of the GPU's events (prefix.MediumGPU); vLLM: "GPU"
	DPRank    int    // data_parallel_rank; < 0: omitted
	MaxBlocks int    // BlockStored events merge at most this many blocks; 0: 256
	// Groups are the layer groups of the events' source when it has more
	// than one (nil: one). With them every BlockStored and BlockRemoved
	// carries vLLM's group_idx (prefix.Event.Group), and every BlockStored
	// its group's kv_cache_spec_kind and kv_cache_spec_sliding_window, as
	// vLLM's events of a hybrid model do; without them the events have none
	// of these fields.
	Groups []GroupSpec
}

// GroupSpec describes a layer group in vLLM's terms (its KVCacheSpecKind):
// Kind is kv_cache_spec_kind ("full_attention", "sliding_window",
// "mamba"), SlidingWindow a sliding-window group's window in tokens (0:
// none), kv_cache_spec_sliding_window.
type GroupSpec struct {
	Kind          string
	SlidingWindow int
}

// vLLM's KVCacheSpecKind values for kvplug's kinds of layer group: a
// recurrent group's state is vLLM's MambaSpec, which its linear-attention
// layers use too.
const (
	SpecFullAttention = "full_attention"
	SpecSlidingWindow = "sliding_window"
	SpecMamba         = "mamba"
)

// maxMergedBlocks is the default bound on the blocks one BlockStored
// carries (vLLM's events carry one request's new blocks).
const maxMergedBlocks = 256

// Encoder turns prefix-cache events into EventBatch payloads. It is not
// safe for concurrent use.
type Encoder struct {
	enc Encoding
	buf []byte
	hex [32]byte
}

// NewEncoder returns an Encoder for enc.
func NewEncoder(enc Encoding) *Encoder {
	if enc.MaxBlocks <= 0 {
		enc.MaxBlocks = maxMergedBlocks
	}
	if enc.Medium == "" {
		enc.Medium = prefix.MediumGPU.String()
	}
	return &Encoder{enc: enc}
}

// mediumName is the "medium" of events of medium m: Encoding.Medium for
// the GPU's, the medium's own name ("CPU", "SHARED") for the others.
func (e *Encoder) mediumName(m prefix.Medium) string {
	if m == prefix.MediumGPU {
		return e.enc.Medium
	}
	return m.String()
}

// storedRun returns how many events from evs[0] (a BlockStored) form one
// chain that one vLLM BlockStored can carry: each a BlockStored whose
// parent is the previous one's hash, with the same medium, group, adapter
// and block size.
func (e *Encoder) storedRun(evs []prefix.Event) int {
	n := 1
	for n < len(evs) && n < e.enc.MaxBlocks {
		a, b := &evs[n-1], &evs[n]
		if b.Kind != prefix.BlockStored || b.Parent != a.Hash || b.Medium != a.Medium || b.Group != a.Group || b.Adapter != a.Adapter || b.BlockSize != a.BlockSize {
			break
		}
		n++
	}
	return n
}

// SnapshotRestField is kvplug's field of an AllBlocksCleared in the map
// form: how many batches after the event's own complete the set it
// begins. A Publisher cuts a drain (a snapshot: AllBlocksCleared and every
// cached block) into batches of at most MaxBatchEvents events, so a set of
// more blocks spans several; a subscriber that applies them as they come
// holds part of the set until the batch numbered the event's batch plus
// this count is applied. The field is written only when that count is
// not 0, and only in the map form: decoders of vLLM's named-field events
// (msgspec's structs, this package's Decode) skip a field they do not
// know, whereas the positional form's trailing places are vLLM's to add
// fields at. Without it, the set is whole once the batch is applied, as
// vLLM's and SGLang's publishers (which cut no snapshot) mean it.
const SnapshotRestField = "kvplug_snapshot_rest"

// MaxSnapshotRest bounds SnapshotRestField on decoding.
const MaxSnapshotRest = 1 << 32

// Encode returns the payload of one batch of evs taken at time ts (seconds
// since the epoch). The result is valid until the next call.
func (e *Encoder) Encode(ts float64, evs []prefix.Event) []byte {
	return e.EncodeSnapshot(ts, evs, 0)
}

// EncodeSnapshot is Encode for a batch followed by rest more batches that
// complete what its AllBlocksCleared begins: each AllBlocksCleared carries
// rest as SnapshotRestField (map form, rest > 0 only).
func (e *Encoder) EncodeSnapshot(ts float64, evs []prefix.Event, rest int) []byte {
	nOut := 0
	for i := 0; i < len(evs); {
		if evs[i].Kind == prefix.BlockStored {
			i += e.storedRun(evs[i:])
		} else {
			i++
		}
		nOut++
	}
	b := e.buf[:0]
	if e.enc.DPRank >= 0 {
		b = msgp.AppendArrayHeader(b, 3)
	} else {
		b = msgp.AppendArrayHeader(b, 2)
	}
	b = msgp.AppendFloat64(b, ts)
	b = msgp.AppendArrayHeader(b, uint32(nOut))
	for i := 0; i < len(evs); {
		switch evs[i].Kind {
		case prefix.BlockStored:
			n := e.storedRun(evs[i:])
			b = e.appendStored(b, evs[i:i+n])
			i += n
		case prefix.BlockRemoved:
			b = e.appendRemoved(b, &evs[i])
			i++
		default:
			if rest > 0 && e.enc.Format == FormatMap {
				b = e.appendTag(b, "AllBlocksCleared", 1)
				b = msgp.AppendString(b, SnapshotRestField)
				b = msgp.AppendInt(b, rest)
			} else {
				b = e.appendTag(b, "AllBlocksCleared", 0)
			}
			i++
		}
	}
	if e.enc.DPRank >= 0 {
		b = msgp.AppendInt(b, e.enc.DPRank)
	}
	e.buf = b
	return b
}

// appendTag starts an event with n fields after its tag.
func (e *Encoder) appendTag(b []byte, tag string, n uint32) []byte {
	if e.enc.Format == FormatArray {
		b = msgp.AppendArrayHeader(b, n+1)
		return msgp.AppendString(b, tag)
	}
	b = msgp.AppendMapHeader(b, n+1)
	b = msgp.AppendString(b, "type")
	return msgp.AppendString(b, tag)
}

// field writes a map key (map format only).
func (e *Encoder) field(b []byte, name string) []byte {
	if e.enc.Format == FormatArray {
		return b
	}
	return msgp.AppendString(b, name)
}

func (e *Encoder) appendHash(b []byte, h prefix.Hash) []byte {
	if e.enc.Hashes == HashInt64 {
		return msgp.AppendUint64(b, binary.BigEndian.Uint64(h[8:]))
	}
	return msgp.AppendBytes(b, h[:])
}

// groupSpec returns the spec of layer group g (zero when unknown).
func (e *Encoder) groupSpec(g int) GroupSpec {
	if g >= 0 && g < len(e.enc.Groups) {
		return e.enc.Groups[g]
	}
	return GroupSpec{}
}

// appendStored writes one BlockStored for a chain of stored blocks. Its
// fields are vLLM's, in vLLM's order; those vLLM omits at their default
// (extra_keys when no block has any, the group's fields without groups)
// are omitted here too, but for the positional form, where a field before
// one given is written as nil.
func (e *Encoder) appendStored(b []byte, run []prefix.Event) []byte {
	hasMM := false
	for i := range run {
		hasMM = hasMM || len(run[i].MM) > 0
	}
	first := &run[0]
	grouped := len(e.enc.Groups) > 0
	spec := e.groupSpec(first.Group)
	array := e.enc.Format == FormatArray
	n := uint32(7)
	if hasMM || grouped && array {
		n++ // extra_keys
	}
	if grouped {
		n++ // group_idx
		if spec.Kind != "" || array && spec.SlidingWindow > 0 {
			n++
		}
		if spec.SlidingWindow > 0 {
			n++
		}
	}
	b = e.appendTag(b, "BlockStored", n)
	b = e.field(b, "block_hashes")
	b = msgp.AppendArrayHeader(b, uint32(len(run)))
	for i := range run {
		b = e.appendHash(b, run[i].Hash)
	}
	b = e.field(b, "parent_block_hash")
	if first.Parent.IsZero() {
		b = msgp.AppendNil(b)
	} else {
		b = e.appendHash(b, first.Parent)
	}
	b = e.field(b, "token_ids")
	b = msgp.AppendArrayHeader(b, uint32(len(run)*first.BlockSize))
	for i := range run {
		for _, t := range run[i].Tokens {
			b = msgp.AppendInt64(b, int64(t))
		}
	}
	b = e.field(b, "block_size")
	b = msgp.AppendInt(b, first.BlockSize)
	b = e.field(b, "lora_id")
	if first.Adapter == 0 {
		b = msgp.AppendNil(b)
	} else {
		b = msgp.AppendUint64(b, first.Adapter)
	}
	b = e.field(b, "medium")
	b = msgp.AppendString(b, e.mediumName(first.Medium))
	b = e.field(b, "lora_name") // kvplug knows adapters by id only
	b = msgp.AppendNil(b)
	if hasMM {
		// One entry per block: None, or a tuple of (content hash as hex,
		// offset of the item relative to the block) pairs: the block's
		// multimodal entries as its hash saw them (HASH.md).
		b = e.field(b, "extra_keys")
		b = msgp.AppendArrayHeader(b, uint32(len(run)))
		for i := range run {
			mm := run[i].MM
			if len(mm) == 0 {
				b = msgp.AppendNil(b)
				continue
			}
			b = msgp.AppendArrayHeader(b, uint32(len(mm)))
			for _, m := range mm {
				b = msgp.AppendArrayHeader(b, 2)
				hex.Encode(e.hex[:], m.Hash[:])
				b = msgp.AppendStringFromBytes(b, e.hex[:])
				b = msgp.AppendInt64(b, int64(m.Offset))
			}
		}
	} else if grouped && array {
		b = msgp.AppendNil(b) // extra_keys, before group_idx
	}
	if grouped {
		b = e.field(b, "group_idx")
		b = msgp.AppendInt(b, first.Group)
		switch {
		case spec.Kind != "":
			b = e.field(b, "kv_cache_spec_kind")
			b = msgp.AppendString(b, spec.Kind)
		case array && spec.SlidingWindow > 0:
			b = msgp.AppendNil(b)
		}
		if spec.SlidingWindow > 0 {
			b = e.field(b, "kv_cache_spec_sliding_window")
			b = msgp.AppendInt(b, spec.SlidingWindow)
		}
	}
	return b
}

// appendRemoved writes one BlockRemoved: vLLM's fields, group_idx with
// groups.
func (e *Encoder) appendRemoved(b []byte, ev *prefix.Event) []byte {
	grouped := len(e.enc.Groups) > 0
	n := uint32(2)
	if grouped {
		n++
	}
	b = e.appendTag(b, "BlockRemoved", n)
	b = e.field(b, "block_hashes")
	b = msgp.AppendArrayHeader(b, uint32(len(ev.Hashes)))
	for _, h := range ev.Hashes {
		b = e.appendHash(b, h)
	}
	b = e.field(b, "medium")
	b = msgp.AppendString(b, e.mediumName(ev.Medium))
	if grouped {
		b = e.field(b, "group_idx")
		b = msgp.AppendInt(b, ev.Group)
	}
	return b
}

// Key is a block hash as a consumer keys it: a 16-byte hash as is, an
// integer hash (HashInt64) in the last 8 bytes (big-endian) after 8 zero
// bytes. KeyOf gives the key of a computed hash in either form.
type Key [16]byte

// KeyOf returns the key under which an event stream in hash format f
// carries hash h.
func KeyOf(h prefix.Hash, f HashFormat) Key {
	if f == HashInt64 {
		var k Key
		copy(k[8:], h[8:])
		return k
	}
	return Key(h)
}

// Decoded event kinds.
const (
	KindStored  = 1
	KindRemoved = 2
	KindCleared = 3
)

// DecodedEvent is one event of a decoded batch.
type DecodedEvent struct {
	Kind       int
	Hashes     []Key // BlockStored: the chain's blocks; BlockRemoved: the removed blocks
	HashFormat HashFormat
	Parent     *Key // BlockStored; nil for a first block
	// Tokens are the blocks' tokens, BlockSize per hash; or none at all,
	// as vLLM's OffloadingConnector sends its CPU blocks (token_ids [],
	// parent None, block_size the offloaded block's, or 0).
	Tokens    []int64
	BlockSize int
	LoRAID    *int64
	LoRAName  *string
	// CacheSalt is SGLang's cache_salt: the salt of the request that
	// stored the blocks (vLLM puts it in a first block's extra keys).
	CacheSalt *string
	// Medium is the event's "medium": "GPU", "CPU", kvplug's "SHARED"
	// (MediumOf maps it), or anything a producer sends; nil when absent.
	Medium    *string
	ExtraKeys []any // raw per-block extra keys (msgpack decoded), nil when absent
	// GroupIdx is vLLM's group_idx: the KV cache group (kvplug: layer
	// group) of a BlockStored's or BlockRemoved's blocks; nil when absent,
	// as from an engine with one group (Group reads it as 0). SpecKind and
	// SlidingWindow are a BlockStored's kv_cache_spec_kind and
	// kv_cache_spec_sliding_window: the group's kind ("full_attention",
	// "sliding_window", "mamba", ...) and window in tokens.
	GroupIdx      *int64
	SpecKind      *string
	SlidingWindow *int64
	// SnapshotRest is an AllBlocksCleared's SnapshotRestField: the
	// batches after this one that complete the set it begins; 0 when
	// absent (the set is whole with this batch).
	SnapshotRest int64

	hasTokens bool // token_ids was given (empty or not)
}

// Group returns the event's layer group: its group_idx, 0 when absent. A
// consumer that keeps one group's blocks (group 0's, full attention: the
// prefix) passes over the others' events, which name the same hashes.
func (ev *DecodedEvent) Group() int64 {
	if ev.GroupIdx == nil {
		return 0
	}
	return *ev.GroupIdx
}

// MediumOf returns the medium of a decoded BlockStored or BlockRemoved:
// GPU when it names none (vLLM's events before "medium"), else the medium
// its name gives in any case (prefix.ParseMedium); ok is false for a name
// kvplug does not know.
func (ev *DecodedEvent) MediumOf() (m prefix.Medium, ok bool) {
	if ev.Medium == nil {
		return prefix.MediumGPU, true
	}
	if strings.EqualFold(*ev.Medium, "CPU_PINNED") {
		return prefix.MediumCPU, true // SGLang's name for its host tier
	}
	return prefix.ParseMedium(*ev.Medium)
}

// Batch is a decoded EventBatch.
type Batch struct {
	TS     float64
	Events []DecodedEvent
	DPRank *int64
}

// Limits of Decode: a payload is untrusted input.
const (
	maxDecodeEvents = 1 << 20
	maxDecodeItems  = 1 << 24 // hashes or tokens in one event
	maxDecodeDepth  = 16
)

// Decode parses an EventBatch payload in either event layout (and a batch
// given as a map, should a producer send one). Unknown fields are skipped;
// a malformed payload is an error, never a panic.
func Decode(p []byte) (*Batch, error) {
	var out Batch
	rest, err := decodeBatch(p, &out)
	if err != nil {
		return nil, err
	}
	if len(rest) != 0 {
		return nil, fmt.Errorf("kvevents: %d bytes after the batch", len(rest))
	}
	return &out, nil
}

func decodeBatch(p []byte, out *Batch) ([]byte, error) {
	switch msgp.NextType(p) {
	case msgp.ArrayType:
		n, p, err := msgp.ReadArrayHeaderBytes(p)
		if err != nil {
			return nil, err
		}
		if n < 2 || n > 3 {
			return nil, fmt.Errorf("kvevents: a batch array of %d elements, 2 or 3 expected", n)
		}
		if out.TS, p, err = readFloat(p); err != nil {
			return nil, fmt.Errorf("kvevents: batch ts: %w", err)
		}
		if p, err = decodeEvents(p, out); err != nil {
			return nil, err
		}
		if n == 3 {
			return readOptInt(p, &out.DPRank)
		}
		return p, nil
	case msgp.MapType:
		n, p, err := msgp.ReadMapHeaderBytes(p)
		if err != nil {
			return nil, err
		}
		seen := false
		for range n {
			var k []byte
			if k, p, err = msgp.ReadStringZC(p); err != nil {
				return nil, err
			}
			switch string(k) {
			case "ts":
				out.TS, p, err = readFloat(p)
			case "events":
				p, err = decodeEvents(p, out)
				seen = true
			case "data_parallel_rank":
				p, err = readOptInt(p, &out.DPRank)
			default:
				p, err = msgp.Skip(p)
			}
			if err != nil {
				return nil, fmt.Errorf("kvevents: batch field %q: %w", k, err)
			}
		}
		if !seen {
			return nil, fmt.Errorf("kvevents: batch without events")
		}
		return p, nil
	}
	return nil, fmt.Errorf("kvevents: a batch must be an array or a map, got %v", msgp.NextType(p))
}

func readFloat(p []byte) (float64, []byte, error) {
	switch msgp.NextType(p) {
	case msgp.Float32Type, msgp.Float64Type:
		return msgp.ReadFloat64Bytes(p)
	case msgp.IntType:
		i, rest, err := msgp.ReadInt64Bytes(p)
		return float64(i), rest, err
	case msgp.UintType:
		u, rest, err := msgp.ReadUint64Bytes(p)
		return float64(u), rest, err
	}
	return 0, nil, fmt.Errorf("a number expected, got %v", msgp.NextType(p))
}

func readOptInt(p []byte, dst **int64) ([]byte, error) {
	return readOpt(p, dst, msgp.ReadInt64Bytes)
}

func readOptString(p []byte, dst **string) ([]byte, error) {
	return readOpt(p, dst, msgp.ReadStringBytes)
}

// readOpt reads a nil, leaving *dst as it is, or a value with read,
// pointing *dst at it.
func readOpt[T any](p []byte, dst **T, read func([]byte) (T, []byte, error)) ([]byte, error) {
	if msgp.NextType(p) == msgp.NilType {
		return msgp.ReadNilBytes(p)
	}
	v, rest, err := read(p)
	if err != nil {
		return nil, err
	}
	*dst = &v
	return rest, nil
}

func decodeEvents(p []byte, out *Batch) ([]byte, error) {
	n, p, err := msgp.ReadArrayHeaderBytes(p)
	if err != nil {
		return nil, fmt.Errorf("kvevents: events: %w", err)
	}
	if n > maxDecodeEvents || int(n) > len(p) {
		return nil, fmt.Errorf("kvevents: %d events in %d bytes", n, len(p))
	}
	out.Events = make([]DecodedEvent, 0, n)
	for i := range n {
		var ev DecodedEvent
		if p, err = decodeEvent(p, &ev); err != nil {
			return nil, fmt.Errorf("kvevents: event %d: %w", i, err)
		}
		out.Events = append(out.Events, ev)
	}
	return p, nil
}

// fieldsOf lists each kind's fields in vLLM's positional order.
var fieldsOf = map[string][]string{
	"BlockStored":      {"block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window", "locality", "ownership", "session_id"},
	"BlockRemoved":     {"block_hashes", "medium", "group_idx", "locality", "ownership"},
	"AllBlocksCleared": {},
}

var kindOf = map[string]int{"BlockStored": KindStored, "BlockRemoved": KindRemoved, "AllBlocksCleared": KindCleared}

func decodeEvent(p []byte, ev *DecodedEvent) ([]byte, error) {
	var tag []byte
	var err error
	switch msgp.NextType(p) {
	case msgp.ArrayType:
		var n uint32
		if n, p, err = msgp.ReadArrayHeaderBytes(p); err != nil {
			return nil, err
		}
		if n < 1 {
			return nil, fmt.Errorf("an event array without its tag")
		}
		if tag, p, err = msgp.ReadStringZC(p); err != nil {
			return nil, fmt.Errorf("tag: %w", err)
		}
		fields, ok := fieldsOf[string(tag)]
		if !ok {
			return nil, fmt.Errorf("unknown event type %q", tag)
		}
		ev.Kind = kindOf[string(tag)]
		for i := uint32(1); i < n; i++ {
			name := ""
			if int(i-1) < len(fields) {
				name = fields[i-1]
			}
			if p, err = ev.field(name, p); err != nil {
				return nil, fmt.Errorf("field %d (%s): %w", i, name, err)
			}
		}
	case msgp.MapType:
		var n uint32
		if n, p, err = msgp.ReadMapHeaderBytes(p); err != nil {
			return nil, err
		}
		// The tag may come anywhere: collect the fields' bytes first.
		type kv struct {
			k string
			v []byte
		}
		var kvs []kv
		for range n {
			var k []byte
			if k, p, err = msgp.ReadStringZC(p); err != nil {
				return nil, fmt.Errorf("event field name: %w", err)
			}
			start := p
			if p, err = msgp.Skip(p); err != nil {
				return nil, fmt.Errorf("event field %q: %w", k, err)
			}
			if string(k) == "type" {
				if tag, _, err = msgp.ReadStringZC(start); err != nil {
					return nil, fmt.Errorf("type: %w", err)
				}
				continue
			}
			kvs = append(kvs, kv{string(k), start[:len(start)-len(p)]})
		}
		kind, ok := kindOf[string(tag)]
		if !ok {
			return nil, fmt.Errorf("unknown event type %q", tag)
		}
		ev.Kind = kind
		for _, f := range kvs {
			if _, err := ev.field(f.k, f.v); err != nil {
				return nil, fmt.Errorf("field %s: %w", f.k, err)
			}
		}
	default:
		return nil, fmt.Errorf("an event must be an array or a map, got %v", msgp.NextType(p))
	}
	if ev.Kind == KindStored {
		// token_ids is required (as in vLLM's struct); empty, it is the
		// hash-only form of vLLM's offloaded blocks.
		if len(ev.Hashes) == 0 || !ev.hasTokens ||
			(len(ev.Tokens) > 0 && (ev.BlockSize < 1 || len(ev.Tokens) != len(ev.Hashes)*ev.BlockSize)) {
			return nil, fmt.Errorf("BlockStored with %d hashes, %d tokens and block size %d", len(ev.Hashes), len(ev.Tokens), ev.BlockSize)
		}
	}
	return p, nil
}

// readItems reads the header of an array of at most maxDecodeItems
// items, no more than the bytes left (each takes one at least); what
// names them in the error.
func readItems(p []byte, what string) (uint32, []byte, error) {
	n, p, err := msgp.ReadArrayHeaderBytes(p)
	if err != nil {
		return 0, nil, err
	}
	if n > maxDecodeItems || int(n) > len(p) {
		return 0, nil, fmt.Errorf("%d %s in %d bytes", n, what, len(p))
	}
	return n, p, nil
}

// field decodes one named field into ev; unknown names are skipped.
func (ev *DecodedEvent) field(name string, p []byte) ([]byte, error) {
	var err error
	switch name {
	case "block_hashes":
		var n uint32
		if n, p, err = readItems(p, "hashes"); err != nil {
			return nil, err
		}
		ev.Hashes = make([]Key, n)
		for i := range ev.Hashes {
			if p, err = ev.readHash(p, &ev.Hashes[i]); err != nil {
				return nil, err
			}
		}
		return p, nil
	case "parent_block_hash":
		if msgp.NextType(p) == msgp.NilType {
			return msgp.ReadNilBytes(p)
		}
		ev.Parent = new(Key)
		return ev.readHash(p, ev.Parent)
	case "token_ids":
		var n uint32
		if n, p, err = readItems(p, "tokens"); err != nil {
			return nil, err
		}
		ev.Tokens = make([]int64, n)
		ev.hasTokens = true
		for i := range ev.Tokens {
			if ev.Tokens[i], p, err = msgp.ReadInt64Bytes(p); err != nil {
				return nil, err
			}
		}
		return p, nil
	case "block_size":
		var v int64
		if v, p, err = msgp.ReadInt64Bytes(p); err != nil {
			return nil, err
		}
		if v < 0 || v > prefix.MaxBlockSize {
			return nil, fmt.Errorf("block_size %d out of [0, %d]", v, prefix.MaxBlockSize)
		}
		ev.BlockSize = int(v)
		return p, nil
	case "lora_id":
		if msgp.NextType(p) == msgp.UintType {
			// An adapter id above 2^63 (kvplug's adapters are uint64).
			u, rest, err := msgp.ReadUint64Bytes(p)
			if err != nil {
				return nil, err
			}
			v := int64(u)
			ev.LoRAID = &v
			return rest, nil
		}
		return readOptInt(p, &ev.LoRAID)
	case "lora_name":
		return readOptString(p, &ev.LoRAName)
	case "cache_salt":
		return readOptString(p, &ev.CacheSalt)
	case "medium":
		return readOptString(p, &ev.Medium)
	case "group_idx":
		return readOptInt(p, &ev.GroupIdx)
	case "kv_cache_spec_kind":
		return readOptString(p, &ev.SpecKind)
	case "kv_cache_spec_sliding_window":
		return readOptInt(p, &ev.SlidingWindow)
	case SnapshotRestField:
		var v int64
		if v, p, err = msgp.ReadInt64Bytes(p); err != nil {
			return nil, err
		}
		if v < 0 || v > MaxSnapshotRest {
			return nil, fmt.Errorf("%s %d out of [0, %d]", SnapshotRestField, v, int64(MaxSnapshotRest))
		}
		ev.SnapshotRest = v
		return p, nil
	case "extra_keys":
		if msgp.NextType(p) == msgp.NilType {
			return msgp.ReadNilBytes(p)
		}
		var n uint32
		if n, p, err = msgp.ReadArrayHeaderBytes(p); err != nil {
			return nil, err
		}
		if int(n) > len(p) {
			return nil, fmt.Errorf("%d extra keys in %d bytes", n, len(p))
		}
		ev.ExtraKeys = make([]any, n)
		for i := range ev.ExtraKeys {
			if ev.ExtraKeys[i], p, err = readAny(p, 0); err != nil {
				return nil, err
			}
		}
		return p, nil
	}
	return msgp.Skip(p)
}

// readAny decodes nil, integers, strings, bytes, floats, booleans and
// arrays of them, to a bounded depth; maps and extensions are refused.
func readAny(p []byte, depth int) (any, []byte, error) {
	if depth > maxDecodeDepth {
		return nil, nil, fmt.Errorf("extra keys nested deeper than %d", maxDecodeDepth)
	}
	switch msgp.NextType(p) {
	case msgp.NilType:
		rest, err := msgp.ReadNilBytes(p)
		return nil, rest, err
	case msgp.IntType:
		return msgp.ReadInt64Bytes(p)
	case msgp.UintType:
		return msgp.ReadUint64Bytes(p)
	case msgp.StrType:
		return msgp.ReadStringBytes(p)
	case msgp.BinType:
		return msgp.ReadBytesBytes(p, nil)
	case msgp.Float32Type, msgp.Float64Type:
		return msgp.ReadFloat64Bytes(p)
	case msgp.BoolType:
		return msgp.ReadBoolBytes(p)
	case msgp.ArrayType:
		n, p, err := msgp.ReadArrayHeaderBytes(p)
		if err != nil {
			return nil, nil, err
		}
		if int(n) > len(p) {
			return nil, nil, fmt.Errorf("an array of %d in %d bytes", n, len(p))
		}
		out := make([]any, n)
		for i := range out {
			if out[i], p, err = readAny(p, depth+1); err != nil {
				return nil, nil, err
			}
		}
		return out, p, nil
	}
	return nil, nil, fmt.Errorf("unsupported extra key type %v", msgp.NextType(p))
}

// readHash reads one hash: 16 bytes, or an unsigned or non-negative integer.
func (ev *DecodedEvent) readHash(p []byte, k *Key) ([]byte, error) {
	switch msgp.NextType(p) {
	case msgp.BinType:
		b, rest, err := msgp.ReadBytesZC(p)
		if err != nil {
			return nil, err
		}
		if len(b) == 16 {
			copy(k[:], b)
			ev.HashFormat = HashBytes
			return rest, nil
		}
		if len(b) == 0 || len(b) > maxForeignHash {
			return nil, fmt.Errorf("a hash of %d bytes; at most %d", len(b), maxForeignHash)
		}
		*k = Key(prefix.Sum(b))
		ev.HashFormat = HashDigest
		return rest, nil
	case msgp.UintType, msgp.IntType:
		var u uint64
		var rest []byte
		var err error
		if msgp.NextType(p) == msgp.IntType {
			// A signed integer: older vLLM hashes were Python ints that
			// could be negative; their two's complement is the key.
			var i int64
			i, rest, err = msgp.ReadInt64Bytes(p)
			u = uint64(i)
		} else {
			u, rest, err = msgp.ReadUint64Bytes(p)
		}
		if err != nil {
			return nil, err
		}
		*k = Key{}
		binary.BigEndian.PutUint64(k[8:], u)
		ev.HashFormat = HashInt64
		return rest, nil
	}
	return nil, fmt.Errorf("a hash must be bytes or an integer, got %v", msgp.NextType(p))
}
