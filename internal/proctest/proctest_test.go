//go:build unix

package proctest

import (
	"os"
	"strings"
	"testing"
	"time"
)

// A process gets a TMPDIR of the test's own, unless its environment sets
// one; what it writes there is gone with the test.
func TestStartGivesATempDir(t *testing.T) {
	var dir string
	t.Run("own", func(t *testing.T) {
		p := Start(t, Cmd{Name: "sh", Bin: "/bin/sh", Args: []string{"-c", `mkdir "$TMPDIR/left" && echo "$TMPDIR"`}, Grace: time.Second})
		<-p.Done()
		dir = strings.TrimSpace(p.Output())
		if dir == "" || dir == os.TempDir() {
			t.Fatalf("TMPDIR %q, want a directory of the test's", dir)
		}
		if _, err := os.Stat(dir + "/left"); err != nil {
			t.Fatal(err)
		}
	})
	if _, err := os.Stat(dir); !os.IsNotExist(err) {
		t.Errorf("%s outlived the test: %v", dir, err)
	}

	p := Start(t, Cmd{Name: "sh", Bin: "/bin/sh", Args: []string{"-c", `echo "$TMPDIR"`}, Env: []string{"TMPDIR=/given"}, Grace: time.Second})
	<-p.Done()
	if got := strings.TrimSpace(p.Output()); got != "/given" {
		t.Errorf("TMPDIR %q, want the one given", got)
	}
}
