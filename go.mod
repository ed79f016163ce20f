module github.com/kvplug/kvplug

go 1.25.0

require (
	github.com/ebitengine/purego v0.11.3
	github.com/tinylib/msgp v1.6.5
	github.com/zeebo/blake3 v0.2.4
	github.com/zeebo/xxh3 v1.1.0
	go.uber.org/zap v1.28.0
	golang.org/x/sys v0.30.0
)

require (
	github.com/klauspost/cpuid/v2 v2.2.10 // indirect
	github.com/philhofer/fwd v1.2.0 // indirect
	go.uber.org/multierr v1.10.0 // indirect
)
