package kvmanager

import (
	"go/ast"
	"go/parser"
	"go/token"
	"path/filepath"
	"strings"
	"testing"
)

// readOnly are the Manager methods that take the lock but change nothing,
// so they release it without the -race build's invariant check.
var readOnly = map[string]bool{"Describe": true, "DescribeGroups": true, "GroupBlocks": true, "Stats": true, "PrefixStats": true, "CheckInvariants": true}

// Every other method that takes the manager's lock must release it with
// m.unlock(), so that -race builds check the invariants after it: a new
// call added with a plain m.mu.Unlock() would escape the per-call check.
func TestEveryCallThatLocksEndsWithTheCheck(t *testing.T) {
	files, err := filepath.Glob("*.go")
	if err != nil {
		t.Fatal(err)
	}
	fset := token.NewFileSet()
	locking := 0
	for _, f := range files {
		if strings.HasSuffix(f, "_test.go") {
			continue
		}
		file, err := parser.ParseFile(fset, f, nil, 0)
		if err != nil {
			t.Fatal(err)
		}
		for _, d := range file.Decls {
			fn, ok := d.(*ast.FuncDecl)
			if !ok || fn.Recv == nil || fn.Body == nil {
				continue
			}
			if star, ok := fn.Recv.List[0].Type.(*ast.StarExpr); !ok || star.X.(*ast.Ident).Name != "Manager" {
				continue
			}
			var locks, plain, checked bool
			ast.Inspect(fn.Body, func(n ast.Node) bool {
				switch x := n.(type) {
				case *ast.CallExpr:
					if sel, ok := x.Fun.(*ast.SelectorExpr); ok && sel.Sel.Name == "Lock" && exprString(sel.X) == "m.mu" {
						locks = true
					}
				case *ast.DeferStmt:
					switch exprString(x.Call.Fun) {
					case "m.mu.Unlock":
						plain = true
					case "m.unlock":
						checked = true
					}
				}
				return true
			})
			if !locks {
				continue
			}
			locking++
			name := fn.Name.Name
			switch {
			case readOnly[name] && !plain:
				t.Errorf("%s: read-only %s should release the lock with defer m.mu.Unlock()", fset.Position(fn.Pos()), name)
			case !readOnly[name] && !checked:
				t.Errorf("%s: %s takes the lock without defer m.unlock(): -race builds would not check the invariants after it (if it changes nothing, add it to readOnly)", fset.Position(fn.Pos()), name)
			}
		}
	}
	if locking < 15 {
		t.Fatalf("found %d methods that take the lock; the scan is broken", locking)
	}
}

func exprString(e ast.Expr) string {
	switch x := e.(type) {
	case *ast.Ident:
		return x.Name
	case *ast.SelectorExpr:
		return exprString(x.X) + "." + x.Sel.Name
	}
	return ""
}
