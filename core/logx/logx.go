// Package logx is the library's logger: zap underneath, delivering each
// entry to a host-provided sink (the C ABI's log callback). With no sink set
// the logger is disabled and costs one atomic load per call site; the library
// never writes to stdout or stderr.
package logx

import (
	"sync/atomic"

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

// Sink receives one formatted entry. It may be called concurrently.
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
	msg := buf.String()
	buf.Free()
	s.sink(toLevel(e.Level), msg)
	return nil
}

func (c *sinkCore) Sync() error { return nil }
