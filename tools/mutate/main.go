// Command mutate runs the mutation list of mutations.txt: each mutation
// replaces one exact snippet of one source file, in a temporary copy of the
// working tree, and runs the tests of that file's package there. A mutant
// the tests fail on (or time out on) is killed; one they pass on survived.
// The working tree itself is never written.
//
// Usage (from the repository root; `make mutate` runs the whole list):
//
//	go run ./tools/mutate [-list FILE] [-pkg DIRS] [-only REGEXP] [-j N]
//	                      [-timeout D] [-report FILE] [-check] [-v]
//
// The list's format is described at the top of mutations.txt. The run
// fails (exit status 1) when a mutant survives that the list does not mark
// equivalent, when a mutation no longer applies or does not compile, or
// when a package's tests fail unmutated.
package main

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"regexp"
	"runtime"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"
)

// mutation is one entry of the list.
type mutation struct {
	ID         string
	File       string // relative to the repository root, slash-separated
	Desc       string
	Equivalent string // why no test can tell it apart; "" for an ordinary mutant
	Tests      string // the package directory whose tests must kill it; "" = the file's
	Orig, Repl string
	Line       int // of the entry in the list
}

func (m *mutation) pkg() string {
	if m.Tests != "" {
		return m.Tests
	}
	return filepath.ToSlash(filepath.Dir(m.File))
}

// list is a parsed mutation list.
type list struct {
	muts  []mutation
	flags map[string][]string // extra go test arguments by package directory
}

// parseList reads the list format of mutations.txt.
func parseList(r io.Reader, name string) (*list, error) {
	l := &list{flags: map[string][]string{}}
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	ln := 0
	var cur *mutation
	mode := "" // "", "orig", "repl"
	var orig, repl []string
	bad := func(f string, a ...any) error {
		return fmt.Errorf("%s:%d: %s", name, ln, fmt.Sprintf(f, a...))
	}
	finish := func() error {
		if cur == nil {
			return nil
		}
		if cur.File == "" || cur.Orig == "" {
			return fmt.Errorf("%s:%d: mutant %s needs a file and a <<< original === replacement >>> block", name, cur.Line, cur.ID)
		}
		l.muts = append(l.muts, *cur)
		cur = nil
		return nil
	}
	for sc.Scan() {
		ln++
		line := sc.Text()
		switch mode {
		case "orig":
			if line == "===" {
				mode = "repl"
				continue
			}
			orig = append(orig, line)
			continue
		case "repl":
			if line == ">>>" {
				mode = ""
				cur.Orig, cur.Repl = strings.Join(orig, "\n"), strings.Join(repl, "\n")
				orig, repl = nil, nil
				continue
			}
			repl = append(repl, line)
			continue
		}
		t := strings.TrimSpace(line)
		if t == "" || strings.HasPrefix(t, "#") {
			continue
		}
		key, val, _ := strings.Cut(t, " ")
		val = strings.TrimSpace(val)
		switch key {
		case "mutant":
			if err := finish(); err != nil {
				return nil, err
			}
			if val == "" {
				return nil, bad("mutant without an id")
			}
			cur = &mutation{ID: val, Line: ln}
		case "flags":
			f := strings.Fields(val)
			if len(f) < 1 {
				return nil, bad("flags needs a package directory")
			}
			l.flags[f[0]] = f[1:]
		case "file", "desc", "equivalent", "tests":
			if cur == nil {
				return nil, bad("%s outside a mutant", key)
			}
			switch key {
			case "file":
				cur.File = val
			case "tests":
				cur.Tests = val
			case "desc":
				cur.Desc = val
			case "equivalent":
				cur.Equivalent = val
			}
		case "<<<":
			if cur == nil || cur.Orig != "" {
				return nil, bad("<<< outside a mutant, or a second one")
			}
			mode = "orig"
		default:
			return nil, bad("unknown line %q", t)
		}
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	if mode != "" {
		return nil, bad("unterminated snippet block")
	}
	if err := finish(); err != nil {
		return nil, err
	}
	seen := map[string]bool{}
	for _, m := range l.muts {
		if seen[m.ID] {
			return nil, fmt.Errorf("%s:%d: mutant id %s used twice", name, m.Line, m.ID)
		}
		seen[m.ID] = true
	}
	return l, nil
}

// status is a mutant's outcome.
type status string

const (
	killed     status = "killed"
	survived   status = "survived"
	equivalent status = "equivalent" // survived, and the list says why it must
	invalid    status = "invalid"    // the snippet is not in the file once, or the mutant does not build
)

type result struct {
	m       *mutation
	st      status
	how     string // killed: the first failing test or "timeout"; invalid: why
	elapsed time.Duration
}

func main() {
	listPath := flag.String("list", "tools/mutate/mutations.txt", "the mutation list")
	pkgs := flag.String("pkg", "", "comma-separated package directories to run (default: every package of the list)")
	only := flag.String("only", "", "run only the mutants whose id matches this regular expression")
	jobs := flag.Int("j", 1, "mutants tested at once, each in its own copy of the tree")
	timeout := flag.Duration("timeout", 0, "limit of one mutant's test run (default: 6 times the package's unmutated run, at least 30s)")
	report := flag.String("report", "", "also write the per-mutant results to this file as markdown")
	check := flag.Bool("check", false, "only check that every mutation applies to the working tree")
	verbose := flag.Bool("v", false, "print the test output of survivors and invalid mutants")
	flag.Parse()

	if err := run(*listPath, *pkgs, *only, *jobs, *timeout, *report, *check, *verbose); err != nil {
		fmt.Fprintln(os.Stderr, "mutate:", err)
		os.Exit(1)
	}
}

func run(listPath, pkgs, only string, jobs int, timeout time.Duration, report string, check, verbose bool) error {
	root, err := os.Getwd()
	if err != nil {
		return err
	}
	if _, err := os.Stat(filepath.Join(root, "go.mod")); err != nil {
		return fmt.Errorf("run from the module root (no go.mod here)")
	}
	f, err := os.Open(listPath)
	if err != nil {
		return err
	}
	l, err := parseList(f, listPath)
	f.Close()
	if err != nil {
		return err
	}
	muts := l.muts
	if pkgs != "" {
		want := map[string]bool{}
		for _, p := range strings.Split(pkgs, ",") {
			want[strings.TrimSuffix(strings.TrimPrefix(strings.TrimSpace(p), "./"), "/")] = true
		}
		muts = slices.DeleteFunc(slices.Clone(muts), func(m mutation) bool { return !want[m.pkg()] })
	}
	if only != "" {
		re, err := regexp.Compile(only)
		if err != nil {
			return err
		}
		muts = slices.DeleteFunc(slices.Clone(muts), func(m mutation) bool { return !re.MatchString(m.ID) })
	}
	if len(muts) == 0 {
		return fmt.Errorf("no mutant selected")
	}

	// Every snippet must occur exactly once in the working tree's file.
	var stale []string
	for i := range muts {
		if err := applies(filepath.Join(root, muts[i].File), &muts[i]); err != nil {
			stale = append(stale, fmt.Sprintf("  %s (%s:%d): %v", muts[i].ID, listPath, muts[i].Line, err))
		}
	}
	if len(stale) > 0 {
		return fmt.Errorf("mutations that no longer apply:\n%s", strings.Join(stale, "\n"))
	}
	if check {
		fmt.Printf("%d mutations apply\n", len(muts))
		return nil
	}

	files, err := treeFiles(root)
	if err != nil {
		return err
	}
	jobs = max(1, min(jobs, len(muts)))
	tmp, err := os.MkdirTemp("", "kvplug-mutate-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(tmp)
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, os.Interrupt, syscall.SIGTERM)
	go func() {
		<-sig
		_ = os.RemoveAll(tmp)
		os.Exit(130)
	}()
	trees := make([]string, jobs)
	for i := range trees {
		trees[i] = filepath.Join(tmp, fmt.Sprintf("tree%d", i))
		if err := copyTree(root, trees[i], files); err != nil {
			return err
		}
	}

	var order []string // packages in list order
	for _, m := range muts {
		if !slices.Contains(order, m.pkg()) {
			order = append(order, m.pkg())
		}
	}
	start := time.Now()
	fmt.Printf("mutate: %d mutants in %d packages, %d at a time\n", len(muts), len(order), jobs)

	// Baseline: each package's tests pass unmutated; their time sets the
	// package's limit (a mutant that loops is killed by it).
	limit := map[string]time.Duration{}
	for _, p := range order {
		t0 := time.Now()
		out, st, _ := goTest(trees[0], p, l.flags[p], max(timeout, 5*time.Minute))
		if st != survived {
			return fmt.Errorf("the tests of %s fail unmutated (%s):\n%s", p, st, tail(out, 40))
		}
		took := time.Since(t0)
		limit[p] = timeout
		if timeout == 0 {
			limit[p] = max(30*time.Second, (6 * took).Round(time.Second))
		}
		fmt.Printf("baseline %-22s ok %6.1fs (limit %s)\n", p, took.Seconds(), limit[p])
	}

	results := make([]result, len(muts))
	work := make(chan int)
	var mu sync.Mutex
	var wg sync.WaitGroup
	done := 0
	for w := range jobs {
		wg.Add(1)
		go func(tree string) {
			defer wg.Done()
			for i := range work {
				r := test(tree, &muts[i], l.flags[muts[i].pkg()], limit[muts[i].pkg()])
				mu.Lock()
				results[i] = r
				done++
				fmt.Printf("[%3d/%d] %-10s %-44s %5.1fs %s\n", done, len(muts), r.st, r.m.ID, r.elapsed.Seconds(), r.how)
				if verbose && (r.st == survived || r.st == invalid) && r.how != "" {
					fmt.Println(indent(r.how))
				}
				mu.Unlock()
			}
		}(trees[w])
	}
	for i := range muts {
		work <- i
	}
	close(work)
	wg.Wait()
	total := time.Since(start)

	summary := summarize(order, results)
	fmt.Print(summary)
	fmt.Printf("\nmutate: %d mutants in %s\n", len(muts), total.Round(time.Second))
	if report != "" {
		if err := os.WriteFile(report, []byte(markdown(order, results, summary, total)), 0o644); err != nil {
			return err
		}
	}
	var failed []string
	for _, r := range results {
		switch r.st {
		case survived:
			failed = append(failed, r.m.ID+" survived")
		case invalid:
			failed = append(failed, r.m.ID+" is invalid: "+firstLine(r.how))
		}
	}
	if len(failed) > 0 {
		return fmt.Errorf("%d mutants need attention:\n  %s", len(failed), strings.Join(failed, "\n  "))
	}
	return nil
}

// applies checks that m's original snippet occurs exactly once in path.
func applies(path string, m *mutation) error {
	b, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	switch n := bytes.Count(b, []byte(m.Orig)); n {
	case 1:
		return nil
	case 0:
		return errors.New("the original snippet is not in the file")
	default:
		return fmt.Errorf("the original snippet occurs %d times in the file", n)
	}
}

// test applies m in tree, runs its package's tests and restores the file.
func test(tree string, m *mutation, flags []string, timeout time.Duration) result {
	t0 := time.Now()
	r := result{m: m}
	path := filepath.Join(tree, m.File)
	orig, err := os.ReadFile(path)
	if err != nil {
		r.st, r.how = invalid, err.Error()
		return r
	}
	if bytes.Count(orig, []byte(m.Orig)) != 1 {
		r.st, r.how = invalid, "the original snippet is not in the copied file exactly once"
		return r
	}
	mutated := bytes.Replace(orig, []byte(m.Orig), []byte(m.Repl), 1)
	if err := writeFile(path, mutated); err != nil {
		r.st, r.how = invalid, err.Error()
		return r
	}
	defer func() { _ = writeFile(path, orig) }()
	out, st, how := goTest(tree, m.pkg(), flags, timeout)
	r.st, r.how, r.elapsed = st, how, time.Since(t0)
	switch st {
	case survived:
		r.how = ""
		if m.Equivalent != "" {
			r.st = equivalent
		}
	case invalid:
		r.how = tail(out, 20)
	case killed:
		if m.Equivalent != "" {
			r.how += " (marked equivalent, but a test tells it apart)"
		}
	}
	return r
}

// writeFile rewrites a file in place (the build cache keys on content).
func writeFile(path string, b []byte) error {
	return os.WriteFile(path, b, 0o644)
}

var (
	failLine  = regexp.MustCompile(`(?m)^\s*--- FAIL: (\S+)`)
	panicLine = regexp.MustCompile(`(?m)^panic: (.*)$`)
)

// goTest runs the tests of package dir pkg in tree: survived when they
// pass, killed when a test fails or the run times out, invalid when the
// package or its tests do not build.
func goTest(tree, pkg string, flags []string, timeout time.Duration) (string, status, string) {
	ctx, cancel := context.WithTimeout(context.Background(), timeout+30*time.Second)
	defer cancel()
	args := append([]string{"test", "-count=1", "-failfast", "-timeout", timeout.String()}, flags...)
	args = append(args, "./"+pkg)
	cmd := exec.CommandContext(ctx, "go", args...)
	cmd.Dir = tree
	cmd.Env = append(os.Environ(), "GOFLAGS=-buildvcs=false", "GOWORK=off")
	cmd.WaitDelay = 10 * time.Second
	var buf bytes.Buffer
	cmd.Stdout, cmd.Stderr = &buf, &buf
	err := cmd.Run()
	out := buf.String()
	if err == nil {
		return out, survived, ""
	}
	if ctx.Err() != nil {
		return out, killed, "timeout"
	}
	if strings.Contains(out, "[build failed]") || strings.Contains(out, "[setup failed]") ||
		!strings.Contains(out, "FAIL") {
		return out, invalid, ""
	}
	if strings.Contains(out, "panic: test timed out") {
		return out, killed, "timeout"
	}
	if m := failLine.FindStringSubmatch(out); m != nil {
		return out, killed, m[1]
	}
	if m := panicLine.FindStringSubmatch(out); m != nil {
		return out, killed, "panic: " + truncate(m[1], 60)
	}
	return out, killed, "FAIL"
}

// treeFiles lists the working tree's files as git sees them (tracked, and
// untracked ones that are not ignored), so that build outputs stay behind.
func treeFiles(root string) ([]string, error) {
	cmd := exec.Command("git", "ls-files", "-z", "--cached", "--others", "--exclude-standard")
	cmd.Dir = root
	out, err := cmd.Output()
	if err != nil {
		return nil, fmt.Errorf("listing the tree's files with git: %w", err)
	}
	var files []string
	for _, f := range strings.Split(string(out), "\x00") {
		if f != "" {
			files = append(files, f)
		}
	}
	return files, nil
}

// copyTree copies files (relative to root) into dst. Files listed but
// deleted in the working tree are skipped.
func copyTree(root, dst string, files []string) error {
	for _, f := range files {
		src := filepath.Join(root, f)
		fi, err := os.Lstat(src)
		if errors.Is(err, fs.ErrNotExist) {
			continue
		}
		if err != nil {
			return err
		}
		to := filepath.Join(dst, f)
		if err := os.MkdirAll(filepath.Dir(to), 0o755); err != nil {
			return err
		}
		switch {
		case fi.Mode()&fs.ModeSymlink != 0:
			target, err := os.Readlink(src)
			if err != nil {
				return err
			}
			if err := os.Symlink(target, to); err != nil {
				return err
			}
		case fi.Mode().IsRegular():
			b, err := os.ReadFile(src)
			if err != nil {
				return err
			}
			if err := os.WriteFile(to, b, fi.Mode().Perm()); err != nil {
				return err
			}
		}
	}
	return nil
}

// summarize tabulates the results per package.
func summarize(order []string, results []result) string {
	var b strings.Builder
	fmt.Fprintf(&b, "\n%-22s %7s %7s %9s %10s %7s\n", "package", "mutants", "killed", "survived", "equivalent", "invalid")
	var tot [5]int
	for _, p := range order {
		var c [5]int
		for _, r := range results {
			if r.m.pkg() != p {
				continue
			}
			c[0]++
			switch r.st {
			case killed:
				c[1]++
			case survived:
				c[2]++
			case equivalent:
				c[3]++
			case invalid:
				c[4]++
			}
		}
		for i := range c {
			tot[i] += c[i]
		}
		fmt.Fprintf(&b, "%-22s %7d %7d %9d %10d %7d\n", p, c[0], c[1], c[2], c[3], c[4])
	}
	fmt.Fprintf(&b, "%-22s %7d %7d %9d %10d %7d\n", "total", tot[0], tot[1], tot[2], tot[3], tot[4])
	for _, st := range []status{survived, equivalent, invalid} {
		first := true
		for _, r := range results {
			if r.st != st {
				continue
			}
			if first {
				fmt.Fprintf(&b, "\n%s:\n", st)
				first = false
			}
			why := r.m.Desc
			if st == equivalent {
				why += " (equivalent: " + r.m.Equivalent + ")"
			}
			if st == invalid {
				why += ": " + firstLine(r.how)
			}
			fmt.Fprintf(&b, "  %-44s %s\n", r.m.ID, why)
		}
	}
	return b.String()
}

// markdown renders a run as a report.
func markdown(order []string, results []result, summary string, total time.Duration) string {
	var b strings.Builder
	host, _ := os.Hostname()
	fmt.Fprintf(&b, "# Mutation run\n\n%s, %s (%d CPUs), %s, %s.\n\n```\n%s```\n\n",
		time.Now().UTC().Format("2006-01-02 15:04 MST"), host, runtime.NumCPU(), runtime.Version(), total.Round(time.Second), strings.TrimLeft(summary, "\n"))
	fmt.Fprintf(&b, "| mutant | file | what | result |\n|---|---|---|---|\n")
	for _, p := range order {
		for _, r := range results {
			if r.m.pkg() != p {
				continue
			}
			res := string(r.st)
			if r.how != "" && r.st == killed {
				res += " by " + r.how
			}
			fmt.Fprintf(&b, "| %s | %s | %s | %s |\n", r.m.ID, r.m.File, strings.ReplaceAll(r.m.Desc, "|", "\\|"), strings.ReplaceAll(res, "|", "\\|"))
		}
	}
	return b.String()
}

func tail(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

func firstLine(s string) string {
	for _, l := range strings.Split(s, "\n") {
		if l = strings.TrimSpace(l); l != "" && !strings.HasPrefix(l, "#") {
			return truncate(l, 120)
		}
	}
	return ""
}

func truncate(s string, n int) string {
	if len(s) > n {
		return s[:n] + "..."
	}
	return s
}

func indent(s string) string {
	return "    " + strings.ReplaceAll(strings.TrimRight(s, "\n"), "\n", "\n    ")
}
