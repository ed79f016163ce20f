package kvindex

import (
	"fmt"
	"math"
	"sync"

	"github.com/kvplug/kvplug/core/kvevents"
	"github.com/kvplug/kvplug/core/prefix"
)

// Engines whose events an instance may carry (InstanceConfig.Engine).
const (
	// EngineKvplug: the instance's manager is kvplug's; its events carry
	// kvplug's block hashes, which the index looks prompts up by, and its
	// publisher answers snapshot requests.
	EngineKvplug = "kvplug"
	// EngineVLLM: vLLM's own KV events (ZmqEventPublisher): the engine's
	// block hashes (SHA-256 bytes or their int64 form), which the index
	// translates into its own from each BlockStored's token_ids and
	// parent, and no snapshots.
	EngineVLLM = "vllm"
	// EngineSGLang: SGLang's KV events, vLLM's wire format: as EngineVLLM.
	EngineSGLang = "sglang"
)

// CheckEngine returns an error unless name is an engine an instance may
// name (InstanceConfig.Engine).
func CheckEngine(name string) error {
	_, err := engineOf(name)
	return err
}

// engineOf reports whether an engine's hashes are ones the index
// translates (foreign), or an error for a name it does not know.
func engineOf(name string) (foreign bool, err error) {
	switch name {
	case "", EngineKvplug:
		return false, nil
	case EngineVLLM, EngineSGLang:
		return true, nil
	}
	return false, fmt.Errorf("unknown engine %q (want %s, %s or %s)", name, EngineKvplug, EngineVLLM, EngineSGLang)
}

// translator rebuilds an instance's blocks under the index's own hashes
// when its engine hashes them its own way. A block's index hash follows
// from its parent's index hash, its tokens and its keys, which every
// BlockStored carries (the parent as the engine's hash, looked up here);
// the engine's hash is then only the block's name, kept to translate the
// events that name it later (BlockRemoved, and a lower tier's hash-only
// BlockStored).
//
// What maps: token blocks, lora_id (a prompt's Keys.Adapter; a block with
// a lora_name but no lora_id is not translated, see loraWithoutID), a cache
// salt (vLLM's cache_salt, the one extra key of a prompt's first block,
// or SGLang's cache_salt field; Keys.Salt is its UTF-8 bytes), and the LoRA name vLLM also puts in
// extra keys (covered by lora_id). A block with other extra keys
// (multimodal items, whose offsets the events do not carry), with a
// parent the index never saw (stored before the index joined), of
// another block size, or with a token outside int32 is not translated,
// nor are its descendants: the index under-reports such blocks, and
// never reports one the engine does not hold.
type translator struct {
	bs int

	mu     sync.Mutex
	h      prefix.Hasher
	blocks map[kvevents.Key]translated
	tok    []int32
}

// translated is one engine block: its index key and the media holding it.
type translated struct {
	key   kvevents.Key
	media uint8 // 1<<Medium
}

func newTranslator(blockSize int) *translator {
	return &translator{bs: blockSize, blocks: map[kvevents.Key]translated{}}
}

// reset forgets every block (AllBlocksCleared, a resync).
func (t *translator) reset() {
	t.mu.Lock()
	clear(t.blocks)
	t.mu.Unlock()
}

// size is the number of engine blocks known.
func (t *translator) size() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.blocks)
}

// stored translates a BlockStored on medium md: the index keys of its
// blocks that translate (a prefix of them), and how many did not.
func (t *translator) stored(ev *kvevents.DecodedEvent, md prefix.Medium) (keys []kvevents.Key, skipped int) {
	t.mu.Lock()
	defer t.mu.Unlock()
	bit := uint8(1) << md
	if len(ev.Tokens) == 0 {
		// Hash-only (vLLM's offloaded blocks): the engine stored these
		// blocks' tokens on another medium first.
		for _, h := range ev.Hashes {
			e, ok := t.blocks[h]
			if !ok {
				skipped++
				continue
			}
			e.media |= bit
			t.blocks[h] = e
			keys = append(keys, e.key)
		}
		return keys, skipped
	}
	var parent prefix.Hash
	if ev.Parent != nil {
		e, ok := t.blocks[*ev.Parent]
		if !ok {
			return nil, len(ev.Hashes)
		}
		parent = prefix.Hash(e.key)
	}
	if ev.BlockSize != t.bs || len(ev.Tokens) != len(ev.Hashes)*t.bs {
		return nil, len(ev.Hashes)
	}
	if loraWithoutID(ev) {
		// An adapter's blocks (and so their descendants): without its id
		// no query's key would find them, and without the adapter they
		// would pass for the base model's.
		return nil, len(ev.Hashes)
	}
	var adapter uint64
	if ev.LoRAID != nil {
		adapter = uint64(*ev.LoRAID) // an id above 2^63 decodes negative
	}
	for i, h := range ev.Hashes {
		var extra any
		if i < len(ev.ExtraKeys) {
			extra = ev.ExtraKeys[i]
		}
		first := i == 0 && ev.Parent == nil
		salt, ok := saltOf(extra, ev.LoRAName, first)
		if ok && first && salt == nil && ev.CacheSalt != nil && *ev.CacheSalt != "" {
			salt = []byte(*ev.CacheSalt) // SGLang's field
		}
		if !ok || !t.tokens(ev.Tokens[i*t.bs:(i+1)*t.bs]) {
			return keys, len(ev.Hashes) - i
		}
		parent = t.h.Next(parent, t.tok, adapter, salt)
		k := kvevents.Key(parent)
		e := t.blocks[h]
		e.key, e.media = k, e.media|bit
		t.blocks[h] = e
		keys = append(keys, k)
	}
	return keys, 0
}

// loraWithoutID reports a BlockStored of a LoRA adapter's blocks that
// names the adapter by lora_name alone (lora_id None or 0: vLLM marks
// lora_id deprecated in favour of the name). The index keys an adapter's
// blocks by its id (Keys.Adapter), so it cannot translate these.
func loraWithoutID(ev *kvevents.DecodedEvent) bool {
	return ev.LoRAName != nil && *ev.LoRAName != "" && (ev.LoRAID == nil || *ev.LoRAID == 0)
}

// tokens converts a block's tokens into t.tok; false when one is outside
// int32 (no prompt the index hashes holds it).
func (t *translator) tokens(src []int64) bool {
	t.tok = t.tok[:0]
	for _, v := range src {
		if v < math.MinInt32 || v > math.MaxInt32 {
			return false
		}
		t.tok = append(t.tok, int32(v))
	}
	return true
}

// removed translates a BlockRemoved on medium md: the index keys of the
// blocks it names that the index knows. A block removed from every medium
// is forgotten.
func (t *translator) removed(ev *kvevents.DecodedEvent, md prefix.Medium) (keys []kvevents.Key, skipped int) {
	t.mu.Lock()
	defer t.mu.Unlock()
	bit := uint8(1) << md
	for _, h := range ev.Hashes {
		e, ok := t.blocks[h]
		if !ok {
			skipped++
			continue
		}
		if e.media &^= bit; e.media == 0 {
			delete(t.blocks, h)
		} else {
			t.blocks[h] = e
		}
		keys = append(keys, e.key)
	}
	return keys, skipped
}

// saltOf reads a block's extra keys: the salt they give it (a first
// block's one key besides the LoRA name), ok false when they hold
// anything the index cannot hash.
func saltOf(extra any, loraName *string, first bool) (salt []byte, ok bool) {
	if extra == nil {
		return nil, true
	}
	list, isList := extra.([]any)
	if !isList {
		list = []any{extra}
	}
	rest := list[:0:0]
	for _, k := range list {
		if s, isStr := k.(string); isStr && loraName != nil && s == *loraName {
			continue
		}
		rest = append(rest, k)
	}
	switch {
	case len(rest) == 0:
		return nil, true
	case len(rest) > 1 || !first:
		return nil, false
	}
	switch v := rest[0].(type) {
	case string:
		salt = []byte(v)
	case []byte:
		salt = v
	default:
		return nil, false
	}
	if len(salt) == 0 || len(salt) > prefix.MaxSaltLen {
		return nil, false
	}
	return salt, true
}
