// Command zsdns is the test cluster's DNS: the little of what CoreDNS does for
// a cluster that tests/deploy/run-k8s-cluster-test needs, answered from the
// API server's EndpointSlices.
//
//	<hostname>.<service>.<namespace>.svc.<domain>  A of the endpoint with that
//	                                               hostname (a StatefulSet pod
//	                                               behind a headless Service)
//	<service>.<namespace>.svc.<domain>             A of every ready endpoint,
//	                                               or the ClusterIP
//
// Every other name is NXDOMAIN (the cluster reaches no outside resolver), and
// an AAAA or other question for a known name has no answer (NODATA). Answers
// live one second: a restarted pod's new address is seen at once.
package main

import (
	"context"
	"flag"
	"log"
	"net"
	"strings"
	"sync"
	"time"

	"github.com/miekg/dns"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
)

type table struct {
	mu    sync.RWMutex
	names map[string][]net.IP // fully qualified, lower case, with the dot
}

func (t *table) lookup(name string) ([]net.IP, bool) {
	t.mu.RLock()
	defer t.mu.RUnlock()
	ips, ok := t.names[strings.ToLower(name)]
	return ips, ok
}

// refresh rebuilds the table from the Services and EndpointSlices.
func (t *table) refresh(ctx context.Context, c kubernetes.Interface, domain string) error {
	svcs, err := c.CoreV1().Services("").List(ctx, metav1.ListOptions{})
	if err != nil {
		return err
	}
	slices, err := c.DiscoveryV1().EndpointSlices("").List(ctx, metav1.ListOptions{})
	if err != nil {
		return err
	}
	names := map[string][]net.IP{}
	headless := map[string]bool{}
	for _, s := range svcs.Items {
		fq := s.Name + "." + s.Namespace + ".svc." + domain
		ip := net.ParseIP(s.Spec.ClusterIP)
		if s.Spec.ClusterIP == "None" || ip == nil {
			headless[fq] = true
			names[fq] = nil
			continue
		}
		names[fq] = []net.IP{ip}
	}
	for _, sl := range slices.Items {
		if sl.AddressType != discoveryv1.AddressTypeIPv4 {
			continue
		}
		svc := sl.Labels[discoveryv1.LabelServiceName]
		fq := svc + "." + sl.Namespace + ".svc." + domain
		if !headless[fq] {
			continue
		}
		for _, ep := range sl.Endpoints {
			var ips []net.IP
			for _, a := range ep.Addresses {
				if ip := net.ParseIP(a); ip != nil {
					ips = append(ips, ip)
				}
			}
			if ep.Hostname != nil && *ep.Hostname != "" {
				host := *ep.Hostname + "." + fq
				names[host] = append(names[host], ips...)
			}
			if ep.Conditions.Ready == nil || *ep.Conditions.Ready {
				names[fq] = append(names[fq], ips...)
			}
		}
	}
	t.mu.Lock()
	t.names = names
	t.mu.Unlock()
	return nil
}

func (t *table) serveDNS(w dns.ResponseWriter, req *dns.Msg) {
	m := new(dns.Msg)
	m.SetReply(req)
	m.Authoritative = true
	if len(req.Question) != 1 {
		m.Rcode = dns.RcodeFormatError
		_ = w.WriteMsg(m)
		return
	}
	q := req.Question[0]
	ips, ok := t.lookup(q.Name)
	switch {
	case !ok:
		m.Rcode = dns.RcodeNameError
	case q.Qtype == dns.TypeA || q.Qtype == dns.TypeANY:
		for _, ip := range ips {
			m.Answer = append(m.Answer, &dns.A{
				Hdr: dns.RR_Header{Name: q.Name, Rrtype: dns.TypeA, Class: dns.ClassINET, Ttl: 1},
				A:   ip.To4(),
			})
		}
	}
	_ = w.WriteMsg(m)
}

func main() {
	kubeconfig := flag.String("kubeconfig", "", "kubeconfig of the cluster")
	listen := flag.String("listen", "127.0.0.1:53", "address to serve on (UDP and TCP)")
	domain := flag.String("domain", "cluster.local", "cluster domain")
	every := flag.Duration("refresh", 500*time.Millisecond, "how often to reread the EndpointSlices")
	flag.Parse()
	cfg, err := clientcmd.BuildConfigFromFlags("", *kubeconfig)
	if err != nil {
		log.Fatalf("zsdns: %v", err)
	}
	client, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		log.Fatalf("zsdns: %v", err)
	}
	d := strings.TrimSuffix(*domain, ".") + "."
	t := &table{names: map[string][]net.IP{}}
	go func() {
		for {
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			if err := t.refresh(ctx, client, d); err != nil {
				log.Printf("zsdns: refresh: %v", err)
			}
			cancel()
			time.Sleep(*every)
		}
	}()
	h := dns.HandlerFunc(t.serveDNS)
	errs := make(chan error, 2)
	for _, proto := range []string{"udp", "tcp"} {
		srv := &dns.Server{Addr: *listen, Net: proto, Handler: h}
		go func() { errs <- srv.ListenAndServe() }()
	}
	log.Printf("zsdns: serving %s on %s", d, *listen)
	log.Fatalf("zsdns: %v", <-errs)
}
