// Package logx is the library's logger: zap underneath, delivering each
// entry to a host-provided sink (the C ABI's log callback). With no sink set
// the logger is disabled and costs one atomic load per call site; the library
// never writes to stdout or stderr.
package logx

import (
	"bytes"
	"runtime"
	"strconv"
	"sync"
	"sync/atomic"

	"github.com/kvplug/kvplug/internal/kverr"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

// Level mirrors enum kvp_log_level.
type Level int32

const (
	Debug Level = 0
	Info  Level = 1
	Warn  Level = 2
	Error Level = 3
	Off   Level = 4
)

// CheckLevel refuses a level outside [Debug, Off] (InvalidArgument).
func CheckLevel(l int) error {
	if l < int(Debug) || l > int(Off) {
		return kverr.Errorf(kverr.InvalidArgument, "log level must be in [%d, %d]: got %d", Debug, Off, l)
	}
	return nil
}

// Sink receives one formatted entry, with no line ending. It may be called
// concurrently. It must not call back into the library: InCallback lets the
// C ABI refuse such calls instead of deadlocking on a lock the logging code
// holds.
type Sink func(level Level, msg string)

type state struct {
	sink  Sink
	level Level
}

var (
	current atomic.Pointer[state]
	logger  = zap.New(&sinkCore{enc: newEncoder()})
)

func init() { current.Store(&state{level: Off}) }

// SetSink installs sink (nil silences the library) with a minimum level.
func SetSink(sink Sink, level Level) {
	current.Store(&state{sink: sink, level: level})
}

// SetLevel changes the minimum level and keeps the sink.
func SetLevel(level Level) {
	old := current.Load()
	current.Store(&state{sink: old.sink, level: level})
}

// L returns the library's logger.
func L() *zap.Logger { return logger }

func newEncoder() zapcore.Encoder {
	// The host adds its own time and level; the line carries the message and
	// structured fields only.
	return zapcore.NewConsoleEncoder(zapcore.EncoderConfig{
		MessageKey:     "msg",
		NameKey:        "logger",
		LineEnding:     "",
		EncodeDuration: zapcore.StringDurationEncoder,
	})
}

func toLevel(l zapcore.Level) Level {
	switch {
	case l <= zapcore.DebugLevel:
		return Debug
	case l == zapcore.InfoLevel:
		return Info
	case l == zapcore.WarnLevel:
		return Warn
	default:
		return Error
	}
}

// sinkCore is a zapcore.Core whose enablement follows the current sink and
// level, so changing them takes effect for loggers created earlier too.
type sinkCore struct {
	enc    zapcore.Encoder
	fields []zapcore.Field
}

func (c *sinkCore) Enabled(l zapcore.Level) bool {
	s := current.Load()
	return s.sink != nil && toLevel(l) >= s.level && s.level != Off
}

func (c *sinkCore) With(fields []zapcore.Field) zapcore.Core {
	clone := &sinkCore{enc: c.enc.Clone(), fields: append(append([]zapcore.Field(nil), c.fields...), fields...)}
	return clone
}

func (c *sinkCore) Check(e zapcore.Entry, ce *zapcore.CheckedEntry) *zapcore.CheckedEntry {
	if c.Enabled(e.Level) {
		return ce.AddCore(e, c)
	}
	return ce
}

func (c *sinkCore) Write(e zapcore.Entry, fields []zapcore.Field) error {
	s := current.Load()
	if s.sink == nil {
		return nil
	}
	buf, err := c.enc.EncodeEntry(e, append(c.fields, fields...))
	if err != nil {
		return err
	}
	// zap ends every entry with a newline even when LineEnding is empty
	// (empty means its default); the host gets the line without it.
	msg := string(bytes.TrimRight(buf.Bytes(), "\r\n"))
	buf.Free()
	deliver(s.sink, toLevel(e.Level), msg)
	return nil
}

// Calls from inside the sink. The host's callback runs on the goroutine
// that logged (a C callback into Go resumes the goroutine that made the C
// call), so that goroutine is marked while the sink runs. delivering counts
// the sinks running, so that while none is, InCallback is one atomic load.
var (
	delivering atomic.Int64
	inSink     sync.Map // goroutine id -> sinks it runs (a sink may log again)
)

func deliver(sink Sink, l Level, msg string) {
	id := goid()
	depth := 0
	if v, ok := inSink.Load(id); ok { // only this goroutine writes its entry
		depth = v.(int)
	}
	inSink.Store(id, depth+1)
	delivering.Add(1)
	defer func() {
		delivering.Add(-1)
		if depth == 0 {
			inSink.Delete(id)
		} else {
			inSink.Store(id, depth)
		}
	}()
	sink(l, msg)
}

// InCallback reports whether the caller runs inside the sink: a library
// call made by the host's log callback.
func InCallback() bool {
	if delivering.Load() == 0 {
		return false
	}
	_, ok := inSink.Load(goid())
	return ok
}

// goid is the calling goroutine's id, read from its stack header
// ("goroutine 123 [running]:"); only needed while a sink runs.
func goid() uint64 {
	var buf [64]byte
	b := buf[:runtime.Stack(buf[:], false)]
	b = bytes.TrimPrefix(b, []byte("goroutine "))
	if i := bytes.IndexByte(b, ' '); i > 0 {
		b = b[:i]
	}
	id, _ := strconv.ParseUint(string(b), 10, 64)
	return id
}

func (c *sinkCore) Sync() error { return nil }
