package main

import (
	"encoding/json"
	"fmt"

	appsv1 "k8s.io/api/apps/v1"
	autoscalingv2 "k8s.io/api/autoscaling/v2"
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/util/managedfields"
	"k8s.io/client-go/applyconfigurations"
	sigsjson "sigs.k8s.io/json"
)

// The API groups a zshard deployment may use. An object of any other kind is
// an error: it could not be validated, and nothing in deploy/k8s needs one.
var apiScheme = func() *runtime.Scheme {
	s := runtime.NewScheme()
	for _, add := range []func(*runtime.Scheme) error{
		corev1.AddToScheme, appsv1.AddToScheme, batchv1.AddToScheme, policyv1.AddToScheme,
		networkingv1.AddToScheme, rbacv1.AddToScheme, autoscalingv2.AddToScheme,
	} {
		if err := add(s); err != nil {
			panic(err)
		}
	}
	return s
}()

// The structural schema of every built-in type, the one kube-apiserver uses
// for server-side apply (compiled into client-go from the OpenAPI document).
var apiTypes = applyconfigurations.NewTypeConverter(apiScheme)

// object is one rendered object that passed schema validation: typed is a
// pointer to its k8s.io/api struct (*appsv1.StatefulSet, ...).
type object struct {
	id    string
	gvk   schema.GroupVersionKind
	typed runtime.Object
}

// validateSchema checks one rendered object twice, independently:
//
//  1. It is decoded into its k8s.io/api Go type with sigs.k8s.io/json's strict
//     mode, the decoder kube-apiserver itself uses for strict field
//     validation: an unknown field, a duplicated field, a field spelled with
//     the wrong case or a value of the wrong type (a string where an integer
//     goes, an unparsable quantity) is an error.
//  2. The same JSON is checked against the structural schema of the type:
//     again unknown fields and wrong types, and also duplicate keys in lists
//     the API treats as maps (two containers or two env entries with one name).
//
// It returns the typed object, or every problem found.
func validateSchema(r rendered) (*object, []error) {
	var head struct {
		APIVersion string `json:"apiVersion"`
		Kind       string `json:"kind"`
	}
	if err := json.Unmarshal(r.json, &head); err != nil {
		return nil, []error{fmt.Errorf("%s: %w", r.id, err)}
	}
	gv, err := schema.ParseGroupVersion(head.APIVersion)
	if err != nil {
		return nil, []error{fmt.Errorf("%s: apiVersion %q: %w", r.id, head.APIVersion, err)}
	}
	gvk := gv.WithKind(head.Kind)
	typed, err := apiScheme.New(gvk)
	if err != nil {
		return nil, []error{fmt.Errorf("%s: %s is not a kind this checker knows (%v)", r.id, gvk, err)}
	}

	var errs []error
	strict, err := sigsjson.UnmarshalStrict(r.json, typed)
	if err != nil {
		errs = append(errs, fmt.Errorf("%s: does not decode as %s: %w", r.id, gvk.Kind, err))
	}
	for _, e := range strict {
		errs = append(errs, fmt.Errorf("%s: %w", r.id, e))
	}

	u := &unstructured.Unstructured{}
	if err := u.UnmarshalJSON(r.json); err != nil {
		errs = append(errs, fmt.Errorf("%s: %w", r.id, err))
	} else if _, err := apiTypes.ObjectToTyped(u); err != nil {
		errs = append(errs, fmt.Errorf("%s: schema: %w", r.id, err))
	}
	if len(errs) > 0 {
		return nil, errs
	}
	return &object{id: r.id, gvk: gvk, typed: typed}, nil
}

// The TypeConverter interface is what applyconfigurations returns; naming it
// here keeps the dependency explicit for readers.
var _ managedfields.TypeConverter = apiTypes
