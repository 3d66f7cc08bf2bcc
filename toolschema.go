package osmo

import (
	"errors"
	"fmt"
	"regexp"
)

// toolNamePattern is OpenAI's rule for function names.
var toolNamePattern = regexp.MustCompile(`^[A-Za-z0-9_-]{1,64}$`)

// ValidateTool checks an OpenAI function tool schema,
// {"type":"function","function":{"name","description","parameters"}}, and
// returns the function's name. parameters, when present, must be a JSON
// Schema object: {"type":"object", "properties":{...}, "required":[...]}
// with every required name among the properties.
func ValidateTool(t Tool) (string, error) {
	if t == nil {
		return "", errors.New("tool is null")
	}
	if typ, _ := t["type"].(string); typ != "function" {
		return "", fmt.Errorf(`tool "type" must be "function", got %v`, t["type"])
	}
	fn, ok := t["function"].(map[string]any)
	if !ok {
		return "", errors.New(`tool "function" must be an object`)
	}
	name, _ := fn["name"].(string)
	if !toolNamePattern.MatchString(name) {
		return "", fmt.Errorf("tool name %q must be 1-64 letters, digits, _ or -", name)
	}
	if d, ok := fn["description"]; ok {
		if _, isText := d.(string); !isText {
			return name, fmt.Errorf("tool %q: description must be a string", name)
		}
	}
	params, ok := fn["parameters"]
	if !ok || params == nil {
		return name, nil
	}
	p, ok := params.(map[string]any)
	if !ok {
		return name, fmt.Errorf("tool %q: parameters must be a JSON Schema object", name)
	}
	if typ, _ := p["type"].(string); typ != "object" {
		return name, fmt.Errorf(`tool %q: parameters.type must be "object", got %v`, name, p["type"])
	}
	props := map[string]any{}
	if raw, ok := p["properties"]; ok && raw != nil {
		if props, ok = raw.(map[string]any); !ok {
			return name, fmt.Errorf("tool %q: parameters.properties must be an object", name)
		}
		for k, v := range props {
			if _, ok := v.(map[string]any); !ok {
				return name, fmt.Errorf("tool %q: parameters.properties.%s must be a schema object", name, k)
			}
		}
	}
	if raw, ok := p["required"]; ok && raw != nil {
		req, ok := raw.([]any)
		if names, isNames := raw.([]string); isNames {
			req, ok = make([]any, len(names)), true
			for i, n := range names {
				req[i] = n
			}
		}
		if !ok {
			return name, fmt.Errorf("tool %q: parameters.required must be an array of property names", name)
		}
		for _, r := range req {
			k, isText := r.(string)
			if !isText {
				return name, fmt.Errorf("tool %q: parameters.required holds %v, not a property name", name, r)
			}
			if _, ok := props[k]; !ok {
				return name, fmt.Errorf("tool %q: required parameter %q is not among the properties", name, k)
			}
		}
	}
	return name, nil
}
