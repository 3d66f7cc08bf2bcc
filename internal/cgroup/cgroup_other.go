//go:build !linux

package cgroup

import (
	"errors"
	"time"
)

// Manager is never returned off Linux: there are no cgroups.
type Manager struct{}

// Detect reports that only Linux has cgroups.
func Detect() (*Manager, error) { return nil, unavailable("cgroups are Linux only") }

func (m *Manager) V2() bool                           { return false }
func (m *Manager) Enforces() (memory, processes bool) { return false, false }
func (m *Manager) String() string                     { return "no cgroups" }
func (m *Manager) New(string, Limits) (*Group, error) { return nil, errors.New("cgroup: Linux only") }

// Group is never created off Linux.
type Group struct{}

func (g *Group) FD() int                 { return -1 }
func (g *Group) Add(int) error           { return errors.New("cgroup: Linux only") }
func (g *Group) Events() (Events, error) { return Events{}, nil }
func (g *Group) Kill(time.Duration) bool { return true }
func (g *Group) Remove() error           { return nil }
func (g *Group) Dirs() []string          { return nil }
